"""`plait plan --explain-run RUN_DIR`: a finished `plait train` run's step parts, measured,
beside the plan's price of the same layout, priced again now with the profiles saved
TODAY in the cache (`plait calibrate`'s link and compute profile, not the ones the run
was priced with when it ran: a calibration since then changes the plan side), else the
compute rates the run measured. Every other `plait plan` flag is ignored.

    plait plan --explain-run runs/gpt-small

Reads RUN_DIR/config.toml (the layout and model) and RUN_DIR/report.json (each rank's
measured parts, the run's measured rates); prints the table the run's report holds
(plait.train.plan_compare). A directory without both, or a report without step parts
(a run of an older plait, or one still running), is refused: a one-line error, exit
status 2 (plait.cli.main's for a ValueError).
"""

from __future__ import annotations

import json
from pathlib import Path

from plait.cli.environment import cache_dir
from plait.train.config import TrainConfig
from plait.train.plan_compare import comparison_lines, step_parts_section


def add_arguments(parser) -> None:
    parser.add_argument("--explain-run", default=None, metavar="RUN_DIR",
                        help="a finished plait train run's measured step parts beside the plan's price of its layout, "
                             "re-priced now with today's saved profiles (plait calibrate's link and compute profile "
                             "in the cache), not the ones the run was priced with; every other flag is ignored")


def _finished_run(directory: Path) -> tuple[dict, dict]:
    """(config as a dict, report.json) of the finished run in ``directory``, or ValueError."""
    missing = [name for name in ("config.toml", "report.json") if not (directory / name).is_file()]
    if missing:
        raise ValueError(f"{directory} is not a finished plait train run (no {' or '.join(missing)}): give the --out "
                         "directory of a run that has finished")
    try:
        report = json.loads((directory / "report.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{directory} is not a finished plait train run: report.json cannot be read ({error})") \
            from None
    section = report.get("step_parts") if isinstance(report, dict) else None
    if not isinstance(section, dict) or not section.get("measured") or not section.get("inputs"):
        raise ValueError(f"{directory} is not a finished plait train run with step parts: its report.json has no "
                         "measured step parts (written by an older plait?); train it again to measure them")
    config = TrainConfig.from_toml(directory / "config.toml").to_dict()
    return config, section


def run_explain(args) -> int:
    directory = Path(args.explain_run)
    config, section = _finished_run(directory)
    priced = step_parts_section(config, section["measured"], section["inputs"], cache_dir=cache_dir())
    print(f"run: {directory} (mesh dp={config['dp']} tp={config['tp']} pp={config['pp']}, model {config['model']}, "
          f"global batch {config['global_batch']}, micro-batch {config['micro_batch']})")
    print("\n".join(comparison_lines(priced)))
    return 0
