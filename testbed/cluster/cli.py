"""`python -m testbed.cluster`: the click commands up, run, shape, down, ls (and the hub's hidden launch)."""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Callable

from .cluster import Cluster
from .launch import ClusterJob, launch_in_hub, launch_job
from .netns import NS_RE, cleanup_stale, down_state, netns_list, pid_alive
from .shaping import shape_node
from .spec import STATE_ROOT, ClusterError, ClusterSpec, ClusterState, Link, parse_rate


def _cli() -> Any:
    import click

    def link_opts(f: Callable[..., Any]) -> Callable[..., Any]:
        f = click.option("--jitter", type=float, default=0.0, show_default=True, help="Delay jitter, ms (netem).")(f)
        f = click.option("--delay", type=float, default=0.0, show_default=True,
                         help="One-way delay of each node's link, ms (needs the kernel's netem).")(f)
        f = click.option("--rate", default="200mbit", show_default=True,
                         help="Each node's link rate, both directions (tbf): 200mbit, 1gbit, 0 = unshaped.")(f)
        return f

    def spec_from(nodes: int, rate: str, delay: float, jitter: float, node_rate: tuple[str, ...],
                  node_delay: tuple[str, ...], cores: str | None, policy: str,
                  daemon_arg: tuple[str, ...], nice: int) -> ClusterSpec:
        base = Link(parse_rate(rate), delay, jitter)
        links: dict[int, Link] = {}
        for item in node_rate:
            i, _, r = item.partition("=")
            links[int(i)] = replace(links.get(int(i), base), rate_mbit=parse_rate(r))
        for item in node_delay:
            i, _, d = item.partition("=")
            links[int(i)] = replace(links.get(int(i), base), delay_ms=float(d))
        core_list = tuple(int(c) for c in cores.split(",")) if cores else ()
        return ClusterSpec(nodes=nodes, link=base, links=links, cores=core_list, policy=policy,
                           daemon_args=daemon_arg, nice=nice)

    def cluster_opts(f: Callable[..., Any]) -> Callable[..., Any]:
        f = click.option("--daemon-arg", multiple=True, help="Extra crossoverd argument (repeatable).")(f)
        f = click.option("--nice", type=click.IntRange(-20, 19), default=0, show_default=True,
                         help="Niceness of daemons and ranks; negative makes the emulated devices outrank "
                              "other work on their cores.")(f)
        f = click.option("--policy", default="crossover", show_default=True,
                         help="crossoverd --policy on every node.")(f)
        f = click.option("--cores", help="Core of each node, e.g. 0,1 (default: usable cores, round-robin).")(f)
        f = click.option("--node-delay", multiple=True, metavar="I=MS", help="Override one node's delay.")(f)
        f = click.option("--node-rate", multiple=True, metavar="I=RATE",
                         help="Override one node's rate (thinner link).")(f)
        f = link_opts(f)
        f = click.option("--nodes", type=click.IntRange(1, 200), default=2, show_default=True)(f)
        return f

    class _Fail(click.ClickException):
        def show(self, file: Any = None) -> None:
            click.echo(f"testbed.cluster: {self.format_message()}", err=True)

    @click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
    @click.option("--log-level", default="WARNING", show_default=True)
    def cli(log_level: str) -> None:
        """Emulated cluster: one network namespace per node, tc-shaped links, one crossoverd per node."""
        logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")

    @cli.command()
    @cluster_opts
    @click.option("--name", help="Register under /run/crossover/clusters/NAME for `run --cluster NAME`.")
    @click.option("--workdir", type=click.Path(file_okay=False), help="Sockets, event logs and job logs go here.")
    def up(name: str | None, workdir: str | None, **kw: Any) -> None:
        """Build a cluster and keep it until Ctrl-C or SIGTERM (then tear it down)."""
        try:
            cluster = Cluster(spec_from(**kw), workdir=workdir, name=name)
            cluster.up()
        except ClusterError as exc:
            raise _Fail(str(exc)) from None
        try:
            state = cluster._require()
            click.echo(f"cluster {name or state.prefix} up in {state.workdir}")
            for n, link in zip(state.nodes, state.links):
                click.echo(f"  {n.name}: netns {n.netns}  {n.address}  core {n.core}  {link.describe()}  "
                           f"CROSSOVER_SOCKET={n.socket}")
            click.echo(f"jobs: python -m testbed.cluster run --cluster {name or state.workdir} -- CMD ...   "
                       "(Ctrl-C here tears down)", err=True)
            sys.stdout.flush()
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            cluster.down()
            click.echo("cluster torn down", err=True)

    @cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
    @click.option("--cluster", "cluster_ref",
                  help="A running cluster (name or work dir); default: build one for this job.")
    @cluster_opts
    @click.option("-np", "--ranks-per-node", "rpn", type=click.IntRange(1), default=1, show_default=True,
                  help="Ranks of the job on each node.")
    @click.option("--job-name", default="job", show_default=True)
    @click.option("--framework", type=click.Choice(["horovod", "ddp"]), default="horovod", show_default=True,
                  help="ddp: COMMAND (python SCRIPT ARGS) runs as `torchrun SCRIPT ARGS` on every node, one "
                       "static rendezvous on the first node.")
    @click.option("--verbose", is_flag=True)
    @click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
    def run(cluster_ref: str | None, rpn: int, job_name: str, framework: str, verbose: bool,
            command: tuple[str, ...], **kw: Any) -> None:
        """Run one Horovod or DDP job (COMMAND) across all nodes; its output is printed as it comes."""
        try:
            if cluster_ref:
                state = ClusterState.load(cluster_ref)
                code = _follow(launch_job(state, command, name=job_name, ranks_per_node=rpn, verbose=int(verbose),
                                          nice=kw["nice"], framework=framework))
            else:
                with Cluster(spec_from(**kw)) as cluster:
                    code = _follow(cluster.run(command, name=job_name, ranks_per_node=rpn, verbose=int(verbose),
                                               framework=framework))
        except ClusterError as exc:
            raise _Fail(str(exc)) from None
        sys.exit(code)

    @cli.command()
    @click.option("--cluster", "cluster_ref", required=True)
    @click.option("--node", type=int, required=True)
    @link_opts
    def shape(cluster_ref: str, node: int, rate: str, delay: float, jitter: float) -> None:
        """Change one node's link of a running cluster."""
        try:
            state = ClusterState.load(cluster_ref)
            if not 0 <= node < len(state.nodes):
                raise ClusterError(f"node {node} does not exist (0..{len(state.nodes) - 1})")
            link = Link(parse_rate(rate), delay, jitter)
            shape_node(state.hub_netns, state.nodes[node].netns, node, link)
        except ClusterError as exc:
            raise _Fail(str(exc)) from None
        click.echo(f"node{node}: {link.describe()}")

    @cli.command()
    @click.argument("cluster_ref", required=False)
    @click.option("--stale", is_flag=True, help="Remove every xo<pid>c<k>* namespace whose owner process is gone.")
    def down(cluster_ref: str | None, stale: bool) -> None:
        """Tear down a cluster by name/work dir (SIGTERM its owner), or clean up after crashed owners."""
        if not cluster_ref and not stale:
            raise click.UsageError("give a cluster name/work dir, or --stale")
        try:
            if cluster_ref:
                state = ClusterState.load(cluster_ref)
                owner = state.owner_pid != os.getpid() and pid_alive(state.owner_pid)
                if owner:
                    os.kill(state.owner_pid, signal.SIGTERM)
                    deadline = time.monotonic() + 20
                    while pid_alive(state.owner_pid) and time.monotonic() < deadline:
                        time.sleep(0.1)
                removed = down_state(state)
                if removed:
                    click.echo(f"removed {' '.join(removed)}")
                else:
                    click.echo(f"{cluster_ref} is down" + (f" (its owner, pid {state.owner_pid}, tore it down)"
                                                           if owner else ""))
            if stale:
                removed = cleanup_stale()
                click.echo(f"stale namespaces removed: {' '.join(removed) or 'none'}")
        except ClusterError as exc:
            raise _Fail(str(exc)) from None

    @cli.command(name="ls")
    def ls_() -> None:
        """List registered clusters and namespaces this tool made."""
        for f in sorted(STATE_ROOT.glob("*/cluster.json")) if STATE_ROOT.exists() else []:
            st = ClusterState.from_json(json.loads(f.read_text()))
            alive = "running" if pid_alive(st.owner_pid) else "owner gone"
            click.echo(f"{f.parent.name}: {len(st.nodes)} nodes, policy {st.policy}, {alive}, {st.workdir}")
        ours = sorted(ns for ns in netns_list() if NS_RE.match(ns))
        click.echo(f"namespaces: {' '.join(ours) or 'none'}")

    @cli.command(hidden=True)
    @click.argument("spec_path")
    def launch(spec_path: str) -> None:
        """Internal: Horovod's Gloo launcher inside the hub namespace."""
        sys.exit(launch_in_hub(spec_path))

    return cli


def _follow(job: ClusterJob) -> int:
    """Stream a job's log to stdout until it ends; Ctrl-C stops the job."""
    pos = 0
    try:
        while True:
            done = job.poll() is not None
            text = job.output()
            if len(text) > pos:
                sys.stdout.write(text[pos:])
                sys.stdout.flush()
                pos = len(text)
            if done:
                return job.proc.returncode
            time.sleep(0.2)
    finally:
        job.stop()


def main(argv: Sequence[str] | None = None) -> None:
    _cli()(args=list(argv) if argv is not None else None, prog_name="python -m testbed.cluster")
