"""benchmarks/results/<benchmark>/ keeps `latest.md` and an append-only `history.jsonl` (one
JSON object per run: device, date, commit, figures) and nothing else: raw logs are summarized
there or kept out of the tree. Every history.jsonl line in the tree names its run with the keys
"date" and "commit" (no line uses other names for them)."""

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
KEEP = ("history.jsonl", "latest.md")
RUN_KEYS = ("date", "commit")
FOLDERS = sorted(p for p in RESULTS.iterdir() if p.is_dir()) if RESULTS.is_dir() else []


def problems(folder: Path) -> list[str]:
    """What keeps `folder` from being a results folder: other files or folders, a missing
    latest.md or history.jsonl, a history line that is not a JSON object naming its run."""
    names = sorted(p.name for p in folder.iterdir())
    found = [f"{name}: only {' and '.join(KEEP)} belong here (summarize a raw log in "
             "latest.md / history.jsonl, or keep it out of the tree)"
             for name in names if name not in KEEP]
    found += [f"{name} missing" for name in KEEP if name not in names]
    history = folder / "history.jsonl"
    if not history.is_file():
        return found
    text = history.read_text()
    if not text.strip():
        return found + ["history.jsonl is empty"]
    if not text.endswith("\n"):
        found.append("history.jsonl does not end with a newline (the next line appended "
                     "would join its last one)")
    for number, line in enumerate(text.splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            found.append(f"history.jsonl line {number}: not JSON ({error})")
            continue
        if not isinstance(record, dict):
            found.append(f"history.jsonl line {number}: not a JSON object")
            continue
        found += [f"history.jsonl line {number}: no {key!r}" for key in RUN_KEYS
                  if not isinstance(record.get(key), str) or not record[key].strip()]
    return found


def test_results_holds_benchmark_folders_only():
    assert FOLDERS, f"no benchmark folder under {RESULTS}"
    loose = sorted(p.name for p in RESULTS.iterdir() if not p.is_dir())
    assert not loose, f"files directly under benchmarks/results/: {loose}"


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_a_results_folder_is_latest_md_and_history_jsonl(folder):
    assert problems(folder) == []


def test_the_check_finds_a_raw_log_a_missing_file_and_a_bad_history_line(tmp_path):
    good = tmp_path / "good"
    good.mkdir()
    (good / "latest.md").write_text("# run\n")
    (good / "history.jsonl").write_text('{"device": "cpu", "date": "2026-12-06", '
                                        '"commit": "abc1234"}\n')
    assert problems(good) == []

    bad = tmp_path / "bad"
    (bad / "logs").mkdir(parents=True)
    (bad / "run.log").write_text("823 passed\n")
    (bad / "history.jsonl").write_text('{"date": "2026-12-06", "commit": "abc1234"}\n'
                                       '["not", "an", "object"]\n'
                                       '{"date": "2026-12-06"}\n'
                                       'not json\n'
                                       '{"commit": "abc1234", "date": ""}')
    found = problems(bad)
    assert sorted(f.split(":")[0] for f in found if "belong here" in f) == ["logs", "run.log"]
    assert "latest.md missing" in found
    assert "history.jsonl line 2: not a JSON object" in found
    assert "history.jsonl line 3: no 'commit'" in found
    assert any(f.startswith("history.jsonl line 4: not JSON") for f in found)
    assert "history.jsonl line 5: no 'date'" in found
    assert any("does not end with a newline" in f for f in found)
    assert not any(f.startswith("history.jsonl line 1:") for f in found)
