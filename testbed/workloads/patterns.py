"""The Horovod patterns users write, in one plain script (no Crossover import), on real data.

Trains an MLP on scikit-learn's bundled `load_digits` under `horovodrun`. Each
flag turns on one pattern the scheduler must survive wherever it appears in
the loop; the conformance tier runs pairs of these as co-located jobs.
Each rank writes a JSON summary (digest, accuracy, steps) to --out.
"""
import argparse
from typing import Any

import horovod.torch as hvd
import torch
import torch.nn as nn

from testbed.workloads.digits import load_digits
from testbed.workloads.quick_exit import skip_final_collections
from testbed.workloads.summary import model_digest, write_rank_summary


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--metric", action="store_true", help="hvd.allreduce of loss and accuracy after every step")
    p.add_argument("--eval", action="store_true", help="evaluate each epoch and average the result (allreduce)")
    p.add_argument("--bpps", type=int, default=1, help="backward_passes_per_step")
    p.add_argument("--clip", action="store_true", help="synchronize(), clip, step() under skip_synchronize()")
    p.add_argument("--no-backward-every", type=int, default=0,
                   help="every N-th step calls step() without a backward first")
    p.add_argument("--gan", action="store_true", help="two models, two DistributedOptimizers, alternating")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--lbbsp", action="store_true",
                   help="the LB-BSP sampler (run with CROSSOVER_AGGREGATION=weighted)")
    p.add_argument("--object-sync", action="store_true",
                   help="broadcast_object and allgather_object each epoch, barrier at the end")
    p.add_argument("--out", default="")
    args = p.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    pixels, labels = load_digits()
    x_all = torch.tensor(pixels / 16.0, dtype=torch.float32)
    y_all = torch.tensor(labels, dtype=torch.int64)
    x, y, x_val, y_val = x_all[:1400], y_all[:1400], x_all[1400:], y_all[1400:]
    data = torch.utils.data.TensorDataset(x, y)
    sampler: Any  # either has set_epoch
    if args.lbbsp:
        from crossover.plugins import aggregation

        sampler = aggregation.batch_sampler(len(data), global_batch=args.batch * hvd.size(), seed=0)
        loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, num_workers=args.workers)
    else:
        sampler = torch.utils.data.distributed.DistributedSampler(data, num_replicas=hvd.size(), rank=hvd.rank())
        loader = torch.utils.data.DataLoader(data, batch_size=args.batch, sampler=sampler,
                                             num_workers=args.workers)

    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   backward_passes_per_step=args.bpps)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    if args.gan:
        critic = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
        hvd.broadcast_parameters(critic.state_dict(), root_rank=0)
        critic_opt = hvd.DistributedOptimizer(torch.optim.SGD(critic.parameters(), lr=0.01),
                                              named_parameters=[("critic." + n, q)
                                                                for n, q in critic.named_parameters()])
    start = hvd.broadcast(torch.tensor(0), root_rank=0, name="resume_from_epoch").item()

    steps = 0
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            if args.no_backward_every and steps % args.no_backward_every == args.no_backward_every - 1:
                opt.step()  # a step on the gradients left from before: no backward this iteration
                steps += 1
                continue
            for chunk_x, chunk_y in zip(xb.chunk(args.bpps), yb.chunk(args.bpps)):
                out = model(chunk_x)
                loss = nn.functional.cross_entropy(out, chunk_y) / args.bpps
                loss.backward()
            if args.clip:
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
            if args.gan:  # the critic learns to score the classifier's outputs, then its own step
                critic_opt.zero_grad()
                score = critic(torch.softmax(model(xb), dim=1).detach()).mean()
                score.backward()
                critic_opt.step()
            if args.metric:
                hvd.allreduce(loss.detach(), name="train_loss")
                hvd.allreduce((out.argmax(1) == chunk_y).float().mean(), name="train_accuracy")
            steps += 1
        if args.eval:
            with torch.no_grad():
                acc = (model(x_val).argmax(1) == y_val).float().mean()
            acc = hvd.allreduce(acc, name="val_accuracy").item()
        if args.object_sync:
            hvd.broadcast_object({"epoch": epoch}, root_rank=0, name=f"state.{epoch}")
            hvd.allgather_object(steps, name=f"steps.{epoch}")
    if args.object_sync:
        hvd.barrier()
    hvd.join()

    with torch.no_grad():
        acc = float((model(x_val).argmax(1) == y_val).float().mean())
    summary = {"rank": hvd.rank(), "digest": model_digest(model), "accuracy": acc, "steps": steps}
    write_rank_summary(args.out, hvd.rank(), summary)
    hvd.shutdown()


if __name__ == "__main__":
    skip_final_collections()
    main()
