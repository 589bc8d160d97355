"""A DDP rank's job id and place from torchrun's variables: pure rules, no torch."""
from __future__ import annotations

from crossover.plugins.hook.torchrun_identity import job_id_from_env, place_from_env


def test_a_named_rendezvous_is_the_job_on_every_node_and_across_restarts():
    node_a = {"TORCHELASTIC_RUN_ID": "exp-42", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    node_b = {"TORCHELASTIC_RUN_ID": "exp-42", "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "31000",
              "TORCHELASTIC_RESTART_COUNT": "2"}  # c10d may move its store when rank 0 changes
    assert job_id_from_env(node_a) == job_id_from_env(node_b)
    assert job_id_from_env(node_a) != job_id_from_env({**node_a, "TORCHELASTIC_RUN_ID": "exp-43"})


def test_a_static_rendezvous_is_the_job_by_its_endpoint():
    one = {"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert job_id_from_env(one) == job_id_from_env(dict(one))
    assert job_id_from_env(one) != job_id_from_env({**one, "MASTER_PORT": "29501"})
    assert job_id_from_env({"TORCHELASTIC_RUN_ID": "none"}) is None  # no endpoint: agree through the store


def test_without_torchrun_there_is_no_id_from_the_environment():
    assert job_id_from_env({}) is None
    assert job_id_from_env({"MASTER_ADDR": "h", "MASTER_PORT": "1"}) is None  # mp.spawn's env:// alone


def test_the_place_takes_the_local_ones_from_torchrun_and_falls_back_to_one_node():
    place = place_from_env({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RESTART_COUNT": "3"}, 5, 8)
    assert (place.rank, place.local_rank, place.world_size, place.local_size, place.restart) == (5, 1, 8, 4, 3)
    alone = place_from_env({"LOCAL_RANK": "x"}, 2, 3)
    assert (alone.local_rank, alone.local_size, alone.restart) == (2, 3, 0)
