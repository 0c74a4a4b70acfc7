"""`ako sweep` and `ako report`: a tiny simulated grid runs, resumes without rerunning finished
cells, and reports the expected files and rows; the report's aggregates on hand-made cells."""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path

import pytest
from helpers import command_line, session

from ako.cli import main
from ako.experiments.grid import load_sweep
from ako.experiments.report import _sig, write_report
from ako.experiments.runner import finished_run

TINY = """
runtime = "simulate"
[base]
dataset = "digits"
model = "mlp"
train_samples = 256
test_samples = 60
batch_size = 16
epochs = 0.25
eval_every = 0.05
seconds_per_sample = 0.001
bandwidth = "100Mbit"
target_accuracy = 0.3
[grid]
workers = [2, 4]
[[arm]]
name = "allreduce"
strategy = "allreduce"
[[arm]]
name = "bsp"
strategy = "bsp"
"""

CELLS = ["arm=allreduce,workers=2", "arm=bsp,workers=2", "arm=allreduce,workers=4", "arm=bsp,workers=4"]


def summaries(sweep_dir) -> dict[str, str]:
    """cell -> its summary.json text (the run directory's name included)."""
    return {p.parent.parent.name: p.parent.name + p.read_text() for p in sweep_dir.glob("cells/*/*/summary.json")}


def table(report: str) -> list[list[str]]:
    rows = [line for line in report.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows]


def test_tiny_sweep_runs_resumes_and_reports(tmp_path, capsys):
    file = tmp_path / "tiny.toml"
    file.write_text(TINY)
    out = tmp_path / "sweep"
    assert main(["sweep", str(file), "--out", str(out), "--jobs", "2", "--no-progress"]) == 0
    first = summaries(out)
    assert sorted(first) == sorted(CELLS)

    # an interrupted cell (no summary) is run again; the finished ones are not
    interrupted = next(out.glob("cells/arm=bsp,workers=4/*/summary.json"))
    interrupted.unlink()
    capsys.readouterr()
    assert main(["sweep", str(file), "--out", str(out), "--no-progress"]) == 0
    assert "3 of 4 cells already finished" in capsys.readouterr().err
    second = summaries(out)
    assert {c: second[c] for c in CELLS if c != "arm=bsp,workers=4"} == {c: first[c] for c in CELLS if c != "arm=bsp,workers=4"}
    assert "arm=bsp,workers=4" in second

    # a changed arm reruns that arm's cells only
    file.write_text(TINY.replace('name = "bsp"\nstrategy = "bsp"', 'name = "bsp"\nstrategy = "bsp"\nservers = 2'))
    capsys.readouterr()
    assert main(["sweep", str(file), "--out", str(out), "--no-progress"]) == 0
    assert "2 of 4 cells already finished" in capsys.readouterr().err
    third = summaries(out)
    assert all(third[c] == second[c] for c in CELLS if "allreduce" in c)
    assert all(third[c] != second[c] for c in CELLS if "bsp" in c)

    assert main(["report", str(out)]) == 0
    report_dir = out / "report"
    pngs = sorted(p.name for p in report_dir.glob("*.png"))
    assert pngs == [
        "accuracy-vs-time_workers=2.png",
        "accuracy-vs-time_workers=4.png",
        "bytes-per-worker-vs-workers.png",
        "time-to-accuracy-vs-workers.png",
    ]
    assert all((report_dir / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    text = (report_dir / "report.md").read_text()
    assert all(f"![{p[:-4]}]({p})" in text for p in pngs)
    rows = table(text)
    assert rows[0][:3] == ["workers", "arm", "time to 30% (s)"]
    assert [r[:2] for r in rows[1:]] == [["2", "allreduce"], ["2", "bsp"], ["4", "allreduce"], ["4", "bsp"]]
    for row in rows[1:]:  # one seed: the final accuracy is the cell's own
        summary = json.loads(next(out.glob(f"cells/arm={row[1]},workers={row[0]}/*/summary.json")).read_text())
        assert row[3] == f"{summary['test_accuracy']:.4f}"
        assert row[5] == _sig(summary["bytes_sent_per_worker_per_second"] / 1e6)
    assert len((report_dir / "cells.csv").read_text().splitlines()) == 1 + 4

    # a cell whose summary was damaged is left out, and both the command and report.md say so
    next(out.glob("cells/arm=bsp,workers=4/*/summary.json")).write_text('{"test_accuracy": ')
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    err = capsys.readouterr().err
    assert err == ("ako report: cell arm=bsp,workers=4 left out: its summary.json or metrics.jsonl cannot be read "
                   "(ako sweep runs it again)\n"), err  # fmt: skip
    text = (report_dir / "report.md").read_text()
    assert "3 of 4 cells finished" in text and "Left out: cell `arm=bsp,workers=4`" in text
    assert [r[:2] for r in table(text)[1:]] == [["2", "allreduce"], ["2", "bsp"], ["4", "allreduce"]]


def test_a_language_model_sweep_reports_time_to_a_loss(tmp_path):
    """A tiny gpt on text, target loss<=X: the table's times and final losses are the cells'
    own, and the plots are named after the loss."""
    words = "the quick brown fox jumps over a lazy dog".split()
    text = tmp_path / "words.txt"
    text.write_text("\n".join(" ".join(words[(i * 7 + j) % 9] for j in range(i % 5 + 3)) for i in range(300)))
    file = tmp_path / "lm.toml"
    file.write_text(textwrap.dedent(f"""
        runtime = "simulate"
        [base]
        dataset = "text:{text}"
        model = "gpt"
        layers = 1
        width = 16
        heads = 2
        context = 16
        batch_size = 8
        optimizer = "adamw"
        lr = 1e-2
        epochs = 0.5
        eval_every = 0.125
        seconds_per_sample = 0.001
        workers = 2
        [grid]
        workers = [2, 3]
        [[arm]]
        name = "ako"
        strategy = "ako"
        [[arm]]
        name = "allreduce"
        strategy = "allreduce"
        [report]
        target = "loss<=2.9"
        budget = 0.05
    """))
    out = tmp_path / "sweep"
    assert main(["sweep", str(file), "--out", str(out), "--jobs", "1", "--no-progress"]) == 0
    assert main(["report", str(out)]) == 0
    report_dir = out / "report"
    assert sorted(p.name for p in report_dir.glob("*.png")) == [
        "bytes-per-worker-vs-workers.png", "loss-at-budget-vs-workers.png", "loss-vs-time_workers=2.png",
        "loss-vs-time_workers=3.png", "time-to-loss-vs-workers.png"]  # fmt: skip
    rows = table((report_dir / "report.md").read_text())
    assert rows[0][:4] == ["workers", "arm", "time to loss<=2.9 (s)", "final loss"]
    for row in rows[1:]:
        run_dir = next(out.glob(f"cells/arm={row[1]},workers={row[0]}/*/summary.json")).parent
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        reached = next(r["time"] for r in records if r.get("test_loss") is not None and r["test_loss"] <= 2.9)
        assert reached > 0 and row[2] == _sig(reached)
        assert row[3] == f"{json.loads((run_dir / 'summary.json').read_text())['test_loss']:.4f}"
        at_budget = [r["test_loss"] for r in records if r.get("test_loss") is not None and r["time"] <= 0.05][-1]
        assert row[4] == f"{at_budget:.4f}"


def test_sweep_on_the_distributed_runtime(tmp_path):
    file = tmp_path / "real.toml"
    file.write_text(TINY.replace('runtime = "simulate"', 'runtime = "train"').replace('seconds_per_sample = 0.001\nbandwidth = "100Mbit"\n', "")
                    .replace("workers = [2, 4]", "workers = [2]").split("[[arm]]")[0])  # fmt: skip
    out = tmp_path / "sweep"
    assert main(["sweep", str(file), "--out", str(out), "--no-progress"]) == 0
    (summary,) = [json.loads(p.read_text()) for p in out.glob("cells/*/*/summary.json")]
    assert summary["workers"] == 2 and summary["strategy"] == "ako" and summary["iterations"] == 2
    assert (out / "cells" / "arm=ako,workers=2" / "log.txt").read_text().count("ako ako: 2 workers") == 1


# --- the report's numbers, on hand-made cells ----------------------------------------------

STRAGGLERS = """
runtime = "simulate"
[base]
dataset = "digits"
workers = 4
target_accuracy = 0.5
[grid.straggler]
"1" = []
"3" = ["rank=3,factor=3"]
[grid]
seed = [0, 1, 2]
[[arm]]
name = "bsp"
strategy = "bsp"
[[arm]]
name = "absp"
strategy = "absp"
[report]
budget = 2.0
"""


def fake_cell(sweep_dir, cell, curve: list[tuple[float, float]], bytes_per_second: int) -> None:
    """A finished cell whose rank 0 evaluated (time, accuracy) at the given points."""
    cell_dir = sweep_dir / "cells" / cell.name
    run = cell_dir / "20261130-000000-run"
    run.mkdir(parents=True)
    (cell_dir / "cell.json").write_text(json.dumps({"settings": cell.settings, "runtime": cell.runtime}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"time": t, "test_accuracy": a}) + "\n" for t, a in curve))
    summary = {"test_accuracy": curve[-1][1], "samples_per_second": 100.0, "bytes_sent_per_worker_per_second": bytes_per_second,
               "per_server": [{"bytes_in_per_second": 4 * bytes_per_second}]}  # fmt: skip
    (run / "summary.json").write_text(json.dumps(summary))


def test_report_means_spreads_and_paired_speedups(tmp_path):
    sweep_dir = tmp_path / "s"
    sweep_dir.mkdir()
    (sweep_dir / "sweep.toml").write_text('name = "stragglers"\n' + STRAGGLERS)
    sweep = load_sweep(sweep_dir / "sweep.toml")
    # bsp reaches 50% at 2, 4, 6 s (straggler 3: 6, 12, 18 s); absp at 1, 2, 3 s; absp at
    # straggler 3 with seed 2 never does
    for cell in sweep.cells():
        seed = int(cell.label("seed"))
        slow = 3 if cell.label("straggler") == "3" else 1
        t = (seed + 1) * (2 if cell.arm == "bsp" else 1) * slow
        reached = not (cell.arm == "absp" and slow == 3 and seed == 2)
        fake_cell(sweep_dir, cell, [(0, 0.1), (t, 0.6 if reached else 0.4), (t + 1, 0.7 if reached else 0.45)], 1000 * (seed + 1))
    text = write_report(sweep_dir)[0].read_text()
    rows = {(r[0], r[1]): r for r in table(text)[1:]}
    header = table(text)[0]
    col = {name: header.index(name) for name in header}
    assert rows[("1", "bsp")][col["time to 50% (s)"]] == "4.00 ± 2.00"
    assert rows[("1", "absp")][col["time to 50% (s)"]] == "2.00 ± 1.00"
    assert rows[("3", "absp")][col["time to 50% (s)"]] == "4.50 ± 2.12 (2/3)"
    assert rows[("1", "absp")][col["speed-up over bsp"]] == "2.00 ± 0.00"
    assert rows[("3", "absp")][col["speed-up over bsp"]] == "2.00 ± 0.00 (2/3)"
    assert rows[("1", "bsp")][col["speed-up over bsp"]] == "baseline"
    assert rows[("1", "bsp")][col["sent per worker (MB/s)"]] == "0.00200 ± 0.00100"
    assert rows[("1", "bsp")][col["server in (MB/s)"]] == "0.00800 ± 0.00400"
    # accuracy at the 2 s budget: the last evaluation at or before 2 s
    assert rows[("1", "bsp")][col["accuracy at 2 s"]] == f"{(0.6 + 0.1 + 0.1) / 3:.4f} ± {0.2886751:.4f}"
    files = sorted(p.name for p in (sweep_dir / "report").glob("*.png"))
    assert files == ["accuracy-vs-time_straggler=1.png", "accuracy-vs-time_straggler=3.png", "speedup-vs-straggler.png"]


@pytest.mark.parametrize(
    "change, message",
    [
        (("[grid]", "[grid]\nflavour = [1]"), "grid: unknown axis 'flavour'"),
        (("[grid]", '[grid]\nout_dir = ["x"]'), "grid: unknown axis 'out_dir'"),
        (('strategy = "bsp"', 'strategy = "bsp"\nworkers = 3'), "arm 'bsp' sets 'workers', which is also an axis of the grid"),
        (('runtime = "simulate"', 'runtime = "cloud"'), "runtime 'cloud': choose simulate or train"),
        (("workers = [2, 4]", "workers = [2, 0]"), "cell arm=allreduce,workers=0: workers 0: must be an integer >= 1"),
        (("workers = [2, 4]", "workers = [2, 2]"), "grid workers: a value is listed twice"),
        (('name = "bsp"\n', 'name = "allreduce"\n'), "arm 'allreduce': two arms have this name"),
        (("[base]", "[bases]"), "unknown key 'bases'"),
        (('strategy = "bsp"', 'strategy = "bsp"\ncolour = 1'), "arm 'bsp': unknown setting 'colour'"),
        (("[grid]", "[report]\nbudget = -1\n[grid]"), "report budget -1: must be a number > 0"),
        (("[base]", "[base]\nresume = 'x'"), "base: 'resume' is set by the sweep for each cell"),
        (("[grid]", "[grid]\nstraggler = 'rank=1'"), "grid straggler 'rank=1': must be a list of values or a table"),
        (('name = "bsp"\n', 'name = "x/y"\n'), "arm 2 name 'x/y': must be letters, digits and"),
        (('runtime = "simulate"', 'runtime = "simulate"\nname = ".."'), "name '..': must be letters, digits"),
        (("[grid]", '[grid.lr]\n"a b" = 0.1\n"a_b" = 0.2\n[grid]'), "would share the directory 'arm=allreduce,lr=a_b,workers=2'"),
        (("[grid]", '[grid.lr]\n"1" = { lr = 0.1, workers = 3 }\n[grid]'), "sets 'workers', which grid"),
        (("[grid]", "[report]\ntarget = 1.5\n[grid]"), "report target 1.5: must be a number > 0 and <= 1"),
        (("[grid]", "[report]\nbudget = inf\n[grid]"), "report budget inf: must be a number > 0 and <= 1e9"),
        (("[base]", "[base]\nbatch-size = 8"), "base: 'batch_size' is given twice, spelled with - and with _"),
        (("[base]", "[base]\nbatch-size = 16"), "base: 'batch_size' is given twice, spelled with - and with _"),
        (("workers = [2, 4]", "workers = [2, 4]\nseed = " + str(list(range(3000)))), "the grid has 12000 cells; at most 10000"),
    ],
)
def test_bad_sweep_files(tmp_path, capsys, change, message):
    file = tmp_path / "bad.toml"
    file.write_text(TINY.replace(*change))
    assert main(["sweep", str(file), "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ako: error: sweep file '{file}': ") and message in err, err
    assert err.count("\n") == 1 and not (tmp_path / "s").exists()


def test_bad_sweep_and_report_arguments(tmp_path, capsys):
    assert main(["sweep", str(tmp_path / "none.toml")]) == 2
    assert "not found" in capsys.readouterr().err
    (tmp_path / "t.toml").write_text(TINY)
    assert main(["sweep", str(tmp_path / "t.toml"), "--jobs", "0"]) == 2
    assert "jobs '0': must be an integer from 1 to 256" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert re.search(r"no sweep.toml in it", capsys.readouterr().err)
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "missing': no such directory (ako sweep writes one under sweeps/)" in capsys.readouterr().err
    (tmp_path / "sweep.toml").write_text(TINY)
    assert main(["report", str(tmp_path)]) == 2
    assert "no finished cell yet" in capsys.readouterr().err
    for text in ("# nothing yet\n", "[base]\n[grid]\n", 'runtime = "simulate"\n'):
        (tmp_path / "empty.toml").write_text(text)
        assert main(["sweep", str(tmp_path / "empty.toml")]) == 2  # it ran a default cell of 2 epochs
        assert "empty.toml': sets no cells; give [base] settings, [grid] axes or [[arm]]s" in capsys.readouterr().err
    for args in (["sweep", ""], ["sweep", str(tmp_path / "t.toml"), "--out", ""], ["report", ""], ["report", str(tmp_path), "--out", ""],
                 ["calibrate", "--dataset", "digits", "--out", ""]):  # '' was read as the current directory
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.endswith(": must be a path, not ''\n"), (args, err)


def test_a_cell_with_bad_input_stops_the_sweep(tmp_path, capsys):
    """Bad input found only when a cell runs (here: no data in --data-dir) would fail every cell."""
    file = tmp_path / "t.toml"
    file.write_text(TINY.replace('dataset = "digits"', f'dataset = "fashion-mnist"\ndata_dir = "{tmp_path / "nothing"}"'))
    assert main(["sweep", str(file), "--out", str(tmp_path / "s"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("ako: error: cell arm=allreduce,workers=2: ") and "nothing" in err, err
    assert not (tmp_path / "s").exists()  # made for this sweep, removed again: nothing left behind


@pytest.mark.parametrize("runtime", ["train", "simulate"])
@pytest.mark.parametrize("setting, name, why", [
    ("model", "own_training:broken_net", "model 'own_training:broken_net' raised RuntimeError: no weights here"),
    ("loss_fn", "own_training:loss_that_raises", "ValueError: labels and logits disagree"),
])  # fmt: skip
def test_a_cell_whose_factory_raises_when_called_is_one_line_before_anything_is_written(tmp_path, capsys, runtime,
                                                                                        setting, name, why):  # fmt: skip
    file, out = tmp_path / "t.toml", tmp_path / "sweeps" / "t"
    text = TINY.replace('runtime = "simulate"', f'runtime = "{runtime}"').replace('model = "mlp"', f'{setting} = "{name}"')
    if runtime == "train":  # the simulator's own settings
        text = text.replace("seconds_per_sample = 0.001\n", "").replace('bandwidth = "100Mbit"\n', "")
    file.write_text(text)
    assert main(["sweep", str(file), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"ako: error: sweep file {str(file)!r}: cell arm=allreduce,workers=2: "), err
    assert why in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.toml"]


def test_sweep_file_documentation_example_parses(tmp_path):
    """The example in ako.experiments.grid's docstring is a valid sweep file."""
    import ako.experiments.grid

    example = ako.experiments.grid.__doc__.split("being compared:")[1].split("Each cell runs")[0]
    file = tmp_path / "example.toml"
    file.write_text(textwrap.dedent(example))
    sweep = load_sweep(file)
    assert len(sweep.cells()) == 2 * 3 * 2 * 2 and sweep.report == {"target": 0.85, "budget": 3.0}


def test_two_sweeps_cannot_share_a_directory(tmp_path, capsys):
    import fcntl

    file, out = tmp_path / "t.toml", tmp_path / "s"
    file.write_text(TINY)
    out.mkdir()
    with open(out / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert main(["sweep", str(file), "--out", str(out)]) == 2
    assert f"sweep directory '{out}': another ako sweep is running in it" in capsys.readouterr().err
    assert not (out / "cells").exists()


def test_an_interrupted_sweep_stops_its_cells_and_resumes(tmp_path):
    """SIGTERM (or Ctrl-C) stops the running cell; the next run finishes the grid, keeping
    the cells finished before the interruption."""
    import subprocess
    import sys
    import time

    file, out = tmp_path / "t.toml", tmp_path / "s"
    file.write_text(TINY.replace("workers = [2, 4]", "workers = [2]").replace("epochs = 0.25", "epochs = 0.25\nseed = 0")
                    .replace('name = "bsp"\nstrategy = "bsp"', 'name = "bsp"\nstrategy = "bsp"\nepochs = 100\ntarget_accuracy = 0.999'))  # fmt: skip
    command = [sys.executable, "-m", "ako", "sweep", str(file), "--out", str(out), "--no-progress"]
    sweep = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    slow = out / "cells" / "arm=bsp,workers=2" / "log.txt"
    deadline = time.monotonic() + 60
    while not (slow.exists() and "ako bsp" not in slow.read_text() and list(slow.parent.glob("*/config.toml"))):
        assert time.monotonic() < deadline and sweep.poll() is None
        time.sleep(0.2)
    sweep.terminate()
    assert sweep.wait(timeout=20) == 130
    assert "interrupted; run the same command again" in sweep.stderr.read()
    left = [pid for pid in session() if "ako serve-cells" in command_line(pid)]
    assert left == [], f"the cell's process is still going: {left}"
    finished_before = summaries(out)
    assert list(finished_before) == ["arm=allreduce,workers=2"]
    file.write_text(file.read_text().replace("epochs = 100\n", ""))  # now the slow cell is quick
    assert main(["sweep", str(file), "--out", str(out), "--no-progress"]) == 0
    after = summaries(out)
    assert after["arm=allreduce,workers=2"] == finished_before["arm=allreduce,workers=2"] and "arm=bsp,workers=2" in after


def test_a_cell_is_finished_only_for_the_same_settings_and_runtime(tmp_path):
    file = tmp_path / "s.toml"
    file.write_text(STRAGGLERS)
    cell = load_sweep(file).cells()[0]
    fake_cell(tmp_path, cell, [(0, 0.1), (1, 0.6)], 1000)
    cell_dir = tmp_path / "cells" / cell.name
    assert finished_run(cell_dir, cell)[0] == next(cell_dir.glob("*/summary.json")).parent
    file.write_text(STRAGGLERS.replace('runtime = "simulate"', 'runtime = "train"'))
    assert finished_run(cell_dir, load_sweep(file).cells()[0]) is None
    file.write_text(STRAGGLERS.replace("workers = 4", "workers = 5"))
    assert finished_run(cell_dir, load_sweep(file).cells()[0]) is None
    (cell_dir / "cell.json").write_text("[1, 2")  # a cell.json cut short
    assert finished_run(cell_dir, cell) is None


@pytest.mark.parametrize("damage", ["summary", "metrics", "cell"])
def test_a_cell_with_damaged_outputs_is_not_finished(tmp_path, damage):
    file = tmp_path / "s.toml"
    file.write_text(STRAGGLERS)
    cell = load_sweep(file).cells()[0]
    fake_cell(tmp_path, cell, [(0, 0.1), (1, 0.6)], 1000)
    cell_dir = tmp_path / "cells" / cell.name
    run = next(cell_dir.glob("*/summary.json")).parent
    {"summary": run / "summary.json", "metrics": run / "metrics.jsonl", "cell": cell_dir / "cell.json"}[damage].write_text("[]")
    assert finished_run(cell_dir, cell) is None


def test_a_report_where_nothing_reached_the_target(tmp_path):
    """Every plot is still written (time to accuracy on a log scale has no point to show)."""
    sweep_dir = tmp_path / "s"
    sweep_dir.mkdir()
    (sweep_dir / "sweep.toml").write_text(TINY)
    for cell in load_sweep(sweep_dir / "sweep.toml").cells():
        fake_cell(sweep_dir, cell, [(0, 0.1), (1, 0.2)], 1000)
    text = write_report(sweep_dir)[0].read_text()
    assert text.count("not reached (0/1)") == 4
    assert (sweep_dir / "report" / "time-to-accuracy-vs-workers.png").read_bytes()[:4] == b"\x89PNG"


def test_a_cell_run_after_another_in_one_process_equals_a_fresh_run(tmp_path):
    """One job slot runs both cells in one long-lived process: the second cell's summary and
    model.pt are those of `ako simulate --config cell.toml` in a fresh process."""
    import subprocess
    import sys

    import torch

    file, out = tmp_path / "t.toml", tmp_path / "s"
    file.write_text(TINY.replace("workers = [2, 4]", "workers = [2]"))
    assert main(["sweep", str(file), "--out", str(out), "--jobs", "1", "--no-progress"]) == 0
    second = out / "cells" / "arm=bsp,workers=2"  # the grid's second cell
    fresh = tmp_path / "fresh"
    command = [sys.executable, "-m", "ako", "simulate", "--config", str(second / "cell.toml"), "--out-dir", str(fresh)]
    subprocess.run(command, check=True, capture_output=True)
    runs = [next(second.glob("*/summary.json")).parent, next(fresh.glob("*/summary.json")).parent]
    drop = {"run_dir", "wall_seconds", "simulation"}
    kept = [{k: v for k, v in json.loads((r / "summary.json").read_text()).items() if k not in drop} for r in runs]
    assert kept[0] == kept[1]
    models = [torch.load(r / "model.pt", weights_only=True) for r in runs]
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])


def test_a_cell_whose_process_dies_fails_and_the_next_cell_runs(tmp_path, capsys):
    """The long-lived process is killed (SIGKILL) in the middle of a cell: that cell fails
    with the signal named, and the next cell runs in a new process and finishes."""
    import signal
    import subprocess
    import threading
    import time

    file, out = tmp_path / "t.toml", tmp_path / "s"
    file.write_text(TINY.replace("workers = [2, 4]", "workers = [2]")
                    .replace('name = "allreduce"\nstrategy = "allreduce"', 'name = "allreduce"\nstrategy = "allreduce"\nepochs = 100\ntarget_accuracy = 0.999'))  # fmt: skip
    slow = out / "cells" / "arm=allreduce,workers=2"

    def kill_when_running():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not list(slow.glob("*/config.toml")):
            time.sleep(0.1)
        pids = []
        while time.monotonic() < deadline and not pids:
            found = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "ako serve-cells"],
                                   capture_output=True, text=True)  # fmt: skip
            pids = found.stdout.split()
        for pid in pids:
            os.kill(int(pid), signal.SIGKILL)

    killer = threading.Thread(target=kill_when_running)
    killer.start()
    status = main(["sweep", str(file), "--out", str(out), "--jobs", "1", "--no-progress"])
    killer.join()
    err = capsys.readouterr().err
    assert status == 1 and "failed arm=allreduce,workers=2" in err and "done   arm=bsp,workers=2" in err
    assert "arm=allreduce,workers=2: its process was killed by SIGKILL" in err


def test_a_diverged_cell_s_line_says_so():
    """A cell whose loss diverged (null in summary.json) gets its one-line result, not a crash
    of the sweep (experiment 2's easgd at 32 workers once stopped the whole sweep here)."""
    from ako.experiments.runner import _outcome

    line = _outcome({"test_metrics": {"accuracy": 0.107, "loss": None}, "target": None}, 12.3)
    assert line == "accuracy 0.1070, loss n/a (diverged) (took 12 s)"


def test_what_a_cell_changes_of_its_process_is_put_back(tmp_path):
    """The working directory, torch's default dtype, thread count and modes are restored after
    a cell (one set to float64 once made the next cells in the same process train otherwise)."""
    import torch

    from ako.experiments.cell_process import _process_state

    before = (os.getcwd(), torch.get_default_dtype(), torch.get_num_threads(), torch.is_anomaly_enabled())
    with _process_state():
        os.chdir(tmp_path)
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(1 if before[2] > 1 else 2)
        torch.set_anomaly_enabled(True)
    assert (os.getcwd(), torch.get_default_dtype(), torch.get_num_threads(), torch.is_anomaly_enabled()) == before


def test_a_cell_process_that_died_between_cells_is_replaced(tmp_path):
    """Killed while idle, the long-lived process is replaced for the next cell (every later
    cell of that slot once failed with a broken pipe)."""
    import signal
    import threading

    from ako.experiments.cell_process import CellProcess

    cells, stop = CellProcess(None), threading.Event()
    try:
        assert cells.run(["info"], tmp_path / "a.txt", stop) == 0
        os.kill(cells.process.pid, signal.SIGKILL)
        cells.process.wait()
        assert cells.run(["info"], tmp_path / "b.txt", stop) == 0
        assert "data set" in (tmp_path / "b.txt").read_text()
    finally:
        cells.close()


@pytest.mark.parametrize("path", sorted((Path(__file__).parent.parent / "experiments").glob("*.toml")), ids=lambda p: p.name)
def test_every_sweep_file_in_experiments_loads(path):
    """The shipped sweep files parse and every cell's settings validate (`load_sweep` checks
    them all), so none fails only once a user runs it."""
    sweep = load_sweep(path)
    cells = sweep.cells()
    assert cells and len({cell.name for cell in cells}) == len(cells)
