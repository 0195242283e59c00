"""Tests for actorq_jax.telemetry: timers, CSV streams, energy, progress line, JSON."""

import io
import json
import math
import threading
import time

import numpy as np
import pytest

from actorq_jax.telemetry import (
    CsvLogger,
    EnergyTracker,
    PhaseTimer,
    ProgressLine,
    read_csv,
    write_json,
)

# ----------------------------------------------------------------- PhaseTimer


def _busy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _FakeClock:
    """A clock that moves only when told to (seconds as exact binary fractions)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_phase_timer_accumulates_per_phase():
    clock = _FakeClock()
    timer = PhaseTimer(clock=clock)
    for _ in range(3):
        with timer.phase("env_step"):
            clock.now += 0.25
    clock.now += 8.0  # time outside any phase is not counted
    with timer.phase("policy"):
        clock.now += 0.5
        with timer.phase("inner"):  # different names nest
            clock.now += 0.125
    assert timer.counts() == {"env_step": 3, "policy": 1, "inner": 1}
    assert timer.totals() == {"env_step": 0.75, "policy": 0.625, "inner": 0.125}


def test_phase_timer_uses_perf_counter_by_default():
    timer = PhaseTimer()
    with timer.phase("busy"):
        _busy(0.002)
    assert timer.totals()["busy"] >= 0.002  # a lower bound only: a loaded machine only adds time


def test_phase_timer_add_from_another_thread_and_reset():
    clock = _FakeClock()
    timer = PhaseTimer(clock=clock)
    with timer.phase("pull"):
        clock.now += 0.5
    worker = threading.Thread(target=lambda: [timer.add("pull", 0.25) for _ in range(4)])
    worker.start()
    worker.join()
    timer.add("deserialize", 0.5)
    assert timer.counts() == {"pull": 5, "deserialize": 1}
    assert timer.totals() == {"pull": 1.5, "deserialize": 0.5}
    timer.reset()
    assert timer.totals() == {} and timer.counts() == {}
    with timer.phase("pull"):
        pass
    assert timer.counts() == {"pull": 1}


def test_phase_timer_counts_block_that_raises_and_rejects_self_nesting():
    timer = PhaseTimer()
    with pytest.raises(KeyError):
        with timer.phase("load"):
            raise KeyError("boom")
    assert timer.counts() == {"load": 1}
    with timer.phase("load"):
        with pytest.raises(RuntimeError, match="load"):
            with timer.phase("load"):
                pass
    with pytest.raises(ValueError, match="seconds"):
        timer.add("load", -1.0)
    with pytest.raises(ValueError, match="phase name"):
        timer.phase("")


def test_phase_timer_reuses_one_context_per_name():
    # Nothing is allocated per timed block: the same object serves every `with` of a name.
    timer = PhaseTimer()
    assert timer.phase("x") is timer.phase("x") and timer.phase("x") is not timer.phase("y")
    for _ in range(1000):
        with timer.phase("x"):
            pass
    assert timer.counts() == {"x": 1000}


# ----------------------------------------------------------------- CsvLogger


def test_csv_logger_header_rows_and_missing_keys(tmp_path):
    path = tmp_path / "sub" / "actors.csv"
    with CsvLogger(path, ["step", "return", "note"]) as log:
        log.write({"step": 1, "return": 0.5, "note": "a,b"})
        log.write({"step": 2})
        log.write({"step": np.int64(3), "return": np.float32(1.5), "note": None})
    lines = path.read_text().splitlines()
    assert lines[0] == "step,return,note"
    assert lines[1] == '1,0.5,"a,b"'
    assert lines[2] == "2,,"
    assert read_csv(path) == [
        {"step": 1, "return": 0.5, "note": "a,b"},
        {"step": 2, "return": None, "note": None},
        {"step": 3, "return": 1.5, "note": None},
    ]


def test_csv_logger_unknown_key_raises_naming_it(tmp_path):
    with CsvLogger(tmp_path / "x.csv", ["a", "b"]) as log:
        with pytest.raises(ValueError, match="'c'"):
            log.write({"a": 1, "c": 2})
        log.write({"a": 1})
    assert read_csv(tmp_path / "x.csv") == [{"a": 1, "b": None}]


def test_csv_logger_reopen_appends_and_rejects_other_header(tmp_path):
    path = tmp_path / "learner.csv"
    with CsvLogger(path, ["step", "loss"]) as log:
        log.write({"step": 1, "loss": 2.0})
    with CsvLogger(path, ["step", "loss"]) as log:  # a resumed run
        log.write({"step": 2, "loss": float("nan")})
    assert path.read_text().count("step,loss") == 1
    rows = read_csv(path)
    assert [r["step"] for r in rows] == [1, 2]
    assert math.isnan(rows[1]["loss"])
    with pytest.raises(ValueError, match="header"):
        CsvLogger(path, ["step", "loss", "extra"])
    assert [r["step"] for r in read_csv(path)] == [1, 2]  # untouched


def test_run_csv_made_by_older_code_goes_on_without_the_newer_columns(tmp_path, caplog):
    from actorq_jax.telemetry.csv_logger import open_run_csv

    path = tmp_path / "actor_0.csv"
    with CsvLogger(path, ["step", "loss"]) as log:  # the run's first part, before "backend" existed
        log.write({"step": 1, "loss": 2.0})
    with caplog.at_level("WARNING"), open_run_csv(path, ["step", "backend", "loss"], flush_every_s=0) as log:
        assert log.dropped_columns == ("backend",) and log.fieldnames == ("step", "loss")
        log.write({"step": 2, "backend": "int8/w8a8/amx", "loss": 3.0})
        with pytest.raises(ValueError, match="unknown CSV column"):  # still only the schema's keys
            log.write({"step": 3, "typo": 1})
    assert "['backend']" in caplog.text and "actor_0.csv" in caplog.text
    assert read_csv(path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 3.0}]
    with pytest.raises(ValueError, match="header"):  # a column the schema does not know: another file
        open_run_csv(path, ["step", "backend"])
    with CsvLogger(tmp_path / "new.csv", ["step", "backend"], keep_older_header=True) as log:
        assert log.dropped_columns == () and log.fieldnames == ("step", "backend")


def test_csv_logger_drops_partial_row_left_by_a_kill(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("step,loss\n1,2.0\n2,3.")  # killed mid-row
    with CsvLogger(path, ["step", "loss"]) as log:
        log.write({"step": 3, "loss": 4.0})
    assert read_csv(path) == [{"step": 1, "loss": 2.0}, {"step": 3, "loss": 4.0}]


@pytest.mark.timeout(30)  # bounds a flusher that never runs; the test asserts no speed
def test_csv_logger_flushes_on_timer_without_close(tmp_path):
    path = tmp_path / "eval.csv"
    log = CsvLogger(path, ["step"], flush_every_s=0.05)
    try:
        log.write({"step": 1})
        while len(path.read_text().splitlines()) < 2:
            time.sleep(0.02)
        # Visible to another reader while the logger is still open.
        assert read_csv(path) == [{"step": 1}]
    finally:
        log.close()
    with pytest.raises(RuntimeError, match="closed"):
        log.write({"step": 2})


def test_csv_logger_flush_every_row(tmp_path):
    path = tmp_path / "r.csv"
    log = CsvLogger(path, ["a"], flush_every_s=0)
    log.write({"a": "x"})
    assert path.read_text() == "a\nx\n"
    log.close()
    log.close()  # idempotent


def test_read_csv_parses_values_and_reads_files_being_written(tmp_path):
    path = tmp_path / "actor_0.csv"
    assert read_csv(path) == []  # not created yet
    path.write_text("")
    assert read_csv(path) == []
    path.write_text("step,ret")  # a header still being written
    assert read_csv(path) == []
    path.write_text("step,ret,policy,tag\r\n")
    assert read_csv(path) == []
    with CsvLogger(path, ["step", "ret", "policy", "tag"], flush_every_s=0) as log:
        log.write({"step": 1, "ret": -2.5, "policy": "actor", "tag": "1_000"})
        log.write({"step": 2, "ret": float("inf"), "policy": 8})
    with open(path, "a", newline="") as f:
        f.write("3,1.")  # the next row, half written
    assert read_csv(path) == [
        {"step": 1, "ret": -2.5, "policy": "actor", "tag": "1_000"},
        {"step": 2, "ret": math.inf, "policy": 8, "tag": None},
    ]


def test_read_csv_short_rows_fill_none_and_long_rows_raise(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("a,b,c\n1\n")
    assert read_csv(path) == [{"a": 1, "b": None, "c": None}]
    path.write_text("a,b\n1,2\n3,4,5\n")
    with pytest.raises(ValueError, match="line 3"):
        read_csv(path)


def test_csv_logger_rejects_bad_fieldnames(tmp_path):
    with pytest.raises(ValueError, match="duplicate"):
        CsvLogger(tmp_path / "d.csv", ["a", "a"])
    with pytest.raises(ValueError, match="empty"):
        CsvLogger(tmp_path / "e.csv", [])


# ----------------------------------------------------------------- ProgressLine


def test_progress_line_throttles_on_non_tty():
    stream, clock = io.StringIO(), _FakeClock()
    line = ProgressLine(stream, clock=clock)  # default: one line per 30 s
    assert not line.is_tty
    shown = []
    for i in range(100):  # 100 updates over 99 seconds
        shown.append(line.update(f"steps {i}"))
        clock.now += 1.0
    assert [i for i, s in enumerate(shown) if s] == [0, 30, 60, 90]
    line.close()
    assert stream.getvalue().splitlines() == ["steps 0", "steps 30", "steps 60", "steps 90", "steps 99"]
    line.close()
    assert stream.getvalue().count("\n") == 5


def test_progress_line_custom_interval_force_and_newlines():
    stream, clock = io.StringIO(), _FakeClock()
    line = ProgressLine(stream, min_interval_s=5, clock=clock)
    line.update("a")
    line.update("b")
    assert line.update("two\nlines", force=True)
    line.close()  # nothing pending: no repeat
    assert stream.getvalue() == "a\ntwo lines\n"
    with pytest.raises(ValueError, match="min_interval_s"):
        ProgressLine(io.StringIO(), min_interval_s=-1)


class _TtyStream(io.StringIO):
    def isatty(self):
        return True


def test_progress_line_rewrites_in_place_on_tty():
    stream, clock = _TtyStream(), _FakeClock()
    line = ProgressLine(stream, clock=clock)
    line.update("one")
    clock.now += 0.01
    assert not line.update("two")  # within 0.1 s: held back
    clock.now += 0.2
    line.update("three")
    line.close()
    assert stream.getvalue() == "\rone\x1b[K\rthree\x1b[K\n"


# ----------------------------------------------------------------- write_json


def test_write_json_numpy_nan_and_atomic_replace(tmp_path):
    path = tmp_path / "out" / "summary.json"
    write_json(path, {"steps": np.int64(5), "ret": np.float32(0.5), "nan": float("nan"),
                      "inf": np.float64("inf"), "arr": np.arange(3), "t": (1, 2), 3: "k"})
    assert json.loads(path.read_text()) == {
        "steps": 5, "ret": 0.5, "nan": None, "inf": None, "arr": [0, 1, 2], "t": [1, 2], "3": "k"
    }
    write_json(path, {"v": 2})
    assert json.loads(path.read_text()) == {"v": 2}
    assert sorted(p.name for p in path.parent.iterdir()) == ["summary.json"]  # no temp left
    with pytest.raises(TypeError, match="object"):
        write_json(path, {"bad": object()})
    assert json.loads(path.read_text()) == {"v": 2}  # a failed write leaves the old file


# ----------------------------------------------------------------- EnergyTracker


@pytest.mark.process  # codecarbon probes the hardware with subprocesses (rocm-smi, nvidia-smi)
@pytest.mark.timeout(30)
def test_energy_tracker_measures_a_busy_interval(tmp_path):
    tracker = EnergyTracker(tmp_path, country_iso_code="FRA")
    tracker.start()
    _busy(0.5)
    result = tracker.stop()
    assert tracker.failure is None
    assert set(result) == {"energy_kwh", "emissions_kg", "duration_s"}
    assert math.isfinite(result["energy_kwh"]) and result["energy_kwh"] > 0
    assert math.isfinite(result["emissions_kg"]) and result["emissions_kg"] >= 0
    assert result["duration_s"] >= 0.5
    assert (tmp_path / "emissions.csv").exists()


@pytest.mark.process  # codecarbon probes the hardware with subprocesses
@pytest.mark.timeout(30)
def test_energy_tracker_rejects_unknown_country(tmp_path):
    with pytest.raises(ValueError, match="XYZ"):
        EnergyTracker(tmp_path, country_iso_code="XYZ")
    with pytest.raises(ValueError, match="tracking_mode"):
        EnergyTracker(tmp_path, tracking_mode="everything")


@pytest.mark.process  # codecarbon probes the hardware with subprocesses
@pytest.mark.timeout(30)
def test_energy_tracker_reports_nan_when_codecarbon_fails(tmp_path, monkeypatch, caplog):
    import codecarbon

    def broken_start(self):
        raise OSError("no power sensor")

    # Failure injection: codecarbon's own start raising, as a broken host would.
    monkeypatch.setattr(codecarbon.OfflineEmissionsTracker, "start", broken_start)
    tracker = EnergyTracker(tmp_path)
    with caplog.at_level("WARNING", logger="actorq_jax.telemetry.energy"):
        tracker.start()
        result = tracker.stop()
    assert math.isnan(result["energy_kwh"]) and math.isnan(result["emissions_kg"])
    assert result["duration_s"] >= 0
    assert "no power sensor" in tracker.failure
    assert "no power sensor" in caplog.text
    with pytest.raises(RuntimeError, match="before start"):
        tracker.stop()


def test_phase_timer_keeps_the_threads_cpu_time_beside_the_wall_time():
    wall, cpu = iter([0.0, 5.0, 10.0, 12.0]), iter([0.0, 1.0, 1.0, 3.0])
    timer = PhaseTimer(clock=lambda: next(wall), cpu_clock=lambda: next(cpu))
    with timer.phase("adder"):  # 5 s of wall, 1 s of CPU: waited on the server or for a core
        pass
    with timer.phase("inference"):  # 2 s of wall, 2 s of CPU: computing
        pass
    timer.add("pull", 0.5, cpu_seconds=0.25)
    assert timer.totals() == {"adder": 5.0, "inference": 2.0, "pull": 0.5}
    assert timer.cpu_totals() == {"adder": 1.0, "inference": 2.0, "pull": 0.25}
    timer.reset()
    assert timer.cpu_totals() == {}


def test_cpu_id_reads_vendor_family_and_model_of_the_first_processor(tmp_path, monkeypatch):
    import builtins

    from actorq_jax.telemetry import machine

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
                       "model name\t: AMD EPYC\n\nprocessor\t: 1\nvendor_id\t: Other\ncpu family\t: 1\nmodel\t\t: 2\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path, *a, **k))
    assert machine.cpu_id() == "AuthenticAMD family 25 model 17"
    assert machine.machine_info()["cpu_id"] == "AuthenticAMD family 25 model 17"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: some ARM core\n")  # no family or model numbers
    assert machine.cpu_id() == ""
