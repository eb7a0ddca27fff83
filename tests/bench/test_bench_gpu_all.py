"""bench/bench_gpu_all.py (`make bench-gpu`): real subprocess parts under one deadline; a part that fails,
hangs past its timeout or finds no time left is a row like the others, and every row is on disk."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "bench_gpu_all.py"


def part(name, code, max_s=30):
    return {"name": name, "argv": [sys.executable, "-c", code], "max_s": max_s}


@pytest.mark.slow  # ~27 s: parts that hang until their timeouts
def test_parts_fail_hang_and_run_out_of_time_without_losing_a_row(tmp_path):
    writes_a_row = "import sys, json; open(sys.argv[1], 'a').write(json.dumps({'step_ms': 57.4}) + '\\n'); print('3 passed')"
    plan = [dict(part("ok", writes_a_row), argv=[sys.executable, "-c", writes_a_row, "{rows}"]),
            part("fails", "raise SystemExit('boom')"),
            part("hangs", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; "
                          "time.sleep(300)']); time.sleep(300)", max_s=25),
            part("late", "print('never')")]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    t0 = time.time()
    # MIN_PART_S is 20: 50 s of deadline leave room for the three first parts (the hang cut at 25 s), not the last
    done = subprocess.run([sys.executable, str(SCRIPT), "--plan", str(tmp_path / "plan.json"), "--deadline", "50",
                           "--json", str(tmp_path / "parts.jsonl"), "--markdown", str(tmp_path / "table.md")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert time.time() - t0 < 80  # the hanging part and its child were killed at their timeout
    rows = [json.loads(line) for line in (tmp_path / "parts.jsonl").read_text().splitlines()]
    assert [(r["part"], r["status"]) for r in rows] == [("ok", "ok"), ("fails", "failed"), ("hangs", "timeout"),
                                                        ("late", "skipped")]
    assert rows[0]["rows"] == [{"step_ms": 57.4}] and rows[1]["exit_code"] == 1 and "boom" in rows[1]["tail"]
    assert 24 <= rows[2]["seconds"] < 35 and "deadline left" in rows[3]["why"]
    assert all(r["commit"] and r["date"] for r in rows)
    table = (tmp_path / "table.md").read_text()
    assert "| ok | ok |" in table and "3 passed" in table and "| hangs | timeout |" in table
    assert table in done.stdout


def test_the_default_plan_names_every_gpu_part():
    listed = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True, text=True, timeout=60,
                            check=True).stdout
    names = [line.split()[0] for line in listed.splitlines()]
    assert names[:2] == ["gpu-tests", "demo-gpu"] and "regen" in names and "head" in names and "online" in names
    variants = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_train_gpu.py"), "--list"],
                              capture_output=True, text=True, timeout=60, check=True).stdout
    every = {line.split()[0] for line in variants.splitlines() if line.strip()}
    assert {n.removeprefix("step:") for n in names if n.startswith("step:")} == every
    refused = subprocess.run([sys.executable, str(SCRIPT), "--only", "nope"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--only nope: not a part" in refused.stderr


def test_the_demo_part_runs_what_make_demo_gpu_runs():
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_gpu_all import default_plan

    demo = next(p for p in default_plan() if p["name"] == "demo-gpu")["argv"]
    make = subprocess.run(["make", "-n", "--no-print-directory", "demo-gpu"], capture_output=True, text=True,
                          cwd=ROOT, check=True).stdout
    line = next(" ".join(x.split()) for x in make.replace("\\\n", " ").splitlines() if "dflash-train demo" in x)
    assert demo[1:] == line.split("dflash-train", 1)[1].split()  # the same recipe, folder, prompts and tokens


def test_the_eval_gpu_part_evaluates_the_demo_parts_drafter_on_the_gpu_into_its_own_file():
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_gpu_all import default_plan

    plan = {p["name"]: p["argv"] for p in default_plan()}
    names = list(plan)
    assert names.index("eval-gpu") == names.index("demo-gpu") + 1  # right after the demo that makes its drafter
    demo, argv = plan["demo-gpu"], plan["eval-gpu"]
    out, prompts, tokens = (demo[demo.index(flag) + 1] for flag in ("--output", "--num-prompts", "--max-new-tokens"))
    assert Path(argv[0]).name == "dflash-train" and argv[1] == "eval"
    for flag, value in (("--draft", f"{out}/drafter"), ("--prompts", f"{out}/run"), ("--num-prompts", prompts),
                        ("--max-new-tokens", tokens), ("--json", f"{out}/eval-gpu.json"), ("--device", "cuda")):
        assert argv[argv.index(flag) + 1] == value, flag
    assert f"{out}/eval.json" not in argv  # never over the demo's own eval


def test_a_parts_tail_keeps_its_lines_and_each_progress_bars_last_frame():
    """A real tqdm bar over 400 items (written to a pipe, frames separated by \\r) between the lines a cut demo
    prints: the tail keeps every line and one frame per bar, its last."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_gpu_all import run_part

    code = ("import sys, time; from tqdm import tqdm\n"
            "print('[demo] train     ok in 265s', flush=True)\n"
            "for _ in tqdm(range(400), desc='replay', mininterval=0, file=sys.stderr): pass\n"
            "print('[demo] eval      ok in 31s', flush=True)\n"
            "for _ in tqdm(range(300), desc='spec-decode', mininterval=0, file=sys.stderr): pass\n"
            "print('# stopped in validate', flush=True)")
    tail = run_part(part("demo", code), timeout=60)["tail"]
    lines = [line for line in tail.splitlines() if line.strip()]
    assert [line for line in lines if not line.startswith(("replay", "spec-decode"))] == [
        "[demo] train     ok in 265s", "[demo] eval      ok in 31s", "# stopped in validate"], lines
    bars = [line for line in lines if line.startswith(("replay", "spec-decode"))]
    assert len(bars) == 2 and "400/400" in bars[0] and "300/300" in bars[1], bars
    assert lines.index(bars[0]) == 1 and lines.index(bars[1]) == 3  # each bar where it ran


def test_a_cut_part_takes_a_child_in_another_session_with_it(tmp_path):
    """bench/variants.py runs each variant in a session of its own; a part cut at its timeout must not leave it
    running (on a GPU, beside the next part)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_gpu_all import run_part

    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import os, sys, time; "
            f"open(sys.argv[1], \"w\").write(str(os.getpid())); time.sleep(300)', {str(pid_file)!r}], "
            "stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)\n"  # as run_child
            "time.sleep(300)")
    result = run_part(part("regen", code), timeout=4)
    assert result["status"] == "timeout"
    pid = int(pid_file.read_text())
    deadline = time.time() + 10
    while time.time() < deadline:
        stat = Path(f"/proc/{pid}/stat")
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the part's child {pid} in its own session still runs after the part was cut")


def test_a_headline_names_each_variants_last_row_in_short_figures_and_counts_a_cut_pytest():
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_gpu_all import headline

    # the 2026-12-04 `regen` part, cut: the loop's two passes and its row, then the baseline's first pass
    rows = [{"variant": "regen", "partial": "pass 1 of 2", "tok_s": 1206.920127854829, "seconds": 103.51},
            {"variant": "regen", "partial": "pass 2 of 2", "tok_s": 30783.00298116176, "seconds": 4.06},
            {"variant": "regen", "tok_s": 30783.00298116176, "first_s": 103.51140652699999},
            {"variant": "regen-generate", "partial": "pass 1 of 2", "tok_s": 950.5, "seconds": 131.2}]
    cell = headline({"status": "timeout", "tail": "", "rows": rows})
    assert cell == "regen: tok_s 30783, first_s 104; regen-generate: partial pass 1 of 2, tok_s 950"
    step = headline({"status": "ok", "tail": "", "rows": [{"variant": "flex-1", "step_s": 0.055911575700002915}]})
    assert step == "flex-1: step_s 0.0559"
    # `pytest -q` cut by its timeout: only its progress line (the 2026-12-04 GPU tests: 10 of 13)
    assert headline({"status": "timeout", "tail": "..F.......", "rows": []}) == \
        "10 tests run before the cut, 1 failed or in error"
    assert headline({"status": "ok", "tail": "....  [100%]\n== 4 passed in 3.1s ==", "rows": []}) == "4 passed in 3.1s"
