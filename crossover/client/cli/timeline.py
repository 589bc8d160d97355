"""`crossover timeline`: a picture of who computed, communicated and waited on each device."""
from __future__ import annotations

import json
from pathlib import Path

import click

from crossover.client.cli import event_views, formatting
from crossover.client.cli._common import ExitCode, Fail
from crossover.client.cli.log_selection import Selection, with_log_options

__all__ = ["timeline"]

_FORMATS = (".png", ".svg", ".pdf")  # what matplotlib writes with no backend beyond its own


_CROWDED = 12  # marks in one picture beyond which their labels overprint: the command says to zoom


def _drawable(_ctx: click.Context, param: click.Parameter, output: Path) -> Path:
    """`output`, a PNG where it names no format (as matplotlib writes it), unless its extension names a
    format the timeline cannot be written in."""
    if not output.suffix:
        return output.with_name(output.name + ".png")
    if output.suffix.lower() not in _FORMATS:
        raise click.BadParameter(f"cannot draw a {output.suffix} file ({output}); name a {', '.join(_FORMATS)} file",
                                 param=param)
    return output


@click.command()
@with_log_options
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default="timeline.png",
              show_default=True, callback=_drawable, help=f"Picture to write: {', '.join(_FORMATS)} (a name "
              "without one gets .png).")
@click.option("--title", help="Title above the picture (default: the files and the window).")
@click.option("--json", "as_json", is_flag=True, help="Print what was drawn as versioned JSON (the PNG's path, the "
              "window, the devices and the marks) instead of the path alone.")
def timeline(files: tuple[Path, ...], since: float | None, until: float | None, job_names: tuple[str, ...],
             output: Path, title: str | None, as_json: bool) -> None:
    """Draw who computed, communicated and waited on each device, from event logs.

    FILES are crossoverd --event-log files, one per node; their clocks are
    aligned by wall time. One band per node and device, one row per rank on
    it: compute solid, allreduce hatched, waiting for a grant pale, a rank
    suspended (silent) dotted red; dashed lines mark policy switches,
    drains, resumes and evictions. Needs matplotlib
    (pip install 'horovod-crossover[plots]').
    """
    if not output.parent.is_dir():
        raise click.BadParameter(f"folder {output.parent} does not exist (create it, or write elsewhere)",
                                 param_hint="'-o' / '--output'")
    sel = Selection(files, since, until, job_names)
    if title is None:
        title = (f"{', '.join(p.name for p in files)}: {sel.since - sel.log.first:.1f} s to "
                 f"{sel.until - sel.log.first:.1f} s" + (f", jobs {', '.join(job_names)}" if job_names else ""))
    marks = [(t, what) for t, what in sorted([(t, f"policy {p}") for t, p in sel.policy_changes]
                                             + sel.operator_marks) if sel.since <= t <= sel.until]
    if len(marks) > _CROWDED:
        click.echo(f"{len(marks)} marks between {sel.since - sel.log.first:.1f} s and {sel.until - sel.log.first:.1f}"
                   " s: their labels overprint; zoom with --since/--until to read them", err=True)
    try:
        path = event_views.draw_timeline(sel.intervals, sel.since, sel.until, output, devices=sel.devices,
                                         marks=marks, title=title, origin=sel.log.first)
    except ImportError as exc:
        raise Fail(f"timeline needs matplotlib ({exc}): pip install 'horovod-crossover[plots]' "
                   "or pip install matplotlib", ExitCode.ERROR) from None
    except OSError as exc:
        raise Fail(f"cannot write {output}: {exc.strerror or exc}", ExitCode.ERROR) from None
    if as_json:
        click.echo(json.dumps({"version": formatting.JSON_VERSION, "kind": "timeline", "path": str(path),
                               "window": {"since_s": sel.since - sel.log.first, "until_s": sel.until - sel.log.first},
                               "devices": [{"node": n, "device": d} for n, d in sel.devices],
                               "marks": [{"t_s": t - sel.log.first, "what": what} for t, what in marks]},
                              indent=2, sort_keys=True))
        return
    click.echo(str(path))
