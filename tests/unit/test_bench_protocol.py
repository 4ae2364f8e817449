"""The measurement protocol: interleaving order, warm-up discarded, median/spread math, result shape."""
import json

import numpy as np
import pytest

from bench import protocol
from bench.protocol import Step


def test_schedule_interleaves_every_config_once_per_repeat_reversing_and_rotating():
    steps = protocol.schedule(["A", "B", "C"], repeats=6, warmup=0)
    orders = [[s.config for s in steps if s.repeat == r] for r in range(6)]
    assert orders == [["A", "B", "C"], ["C", "B", "A"], ["B", "C", "A"], ["A", "C", "B"], ["C", "A", "B"],
                      ["B", "A", "C"]]
    assert all(s.phase == "measure" for s in steps)
    for c in "ABC":  # every configuration once in every place
        assert sorted(order.index(c) for order in orders) == [0, 0, 1, 1, 2, 2]


def test_schedule_runs_a_cells_targets_both_ways_round_in_two_repeats():
    """served.py's configurations come cell by cell, a cell's targets side by side: two repeats must not run
    them in the same order twice (a rotation by one alone did, 2026-12-04)."""
    configs = [f"{t}/c{c}" for c in (256, 1000) for t in ("pulse", "pulse-b256", "pulse-qgc")]
    steps = protocol.schedule(configs, repeats=2, warmup=1)
    for r in range(2):
        order = [s.config for s in steps if s.phase == "measure" and s.repeat == r]
        firsts = [name for name in order if name.endswith("/c256")]
        assert firsts == (configs[:3] if r == 0 else configs[:3][::-1])


def test_schedule_puts_warmup_first_and_measures_both_orders_after_it():
    steps = protocol.schedule(["A", "B"], repeats=2, warmup=1)
    assert steps == [Step("warmup", 0, "A"), Step("warmup", 0, "B"),
                     Step("measure", 0, "A"), Step("measure", 0, "B"),
                     Step("measure", 1, "B"), Step("measure", 1, "A")]


@pytest.mark.parametrize("configs,repeats,warmup", [([], 5, 2), (["A", "A"], 5, 2), (["A"], 0, 2), (["A"], 5, -1)])
def test_schedule_rejects_bad_input(configs, repeats, warmup):
    with pytest.raises(ValueError):
        protocol.schedule(configs, repeats, warmup)


def test_spread_is_median_min_max():
    assert protocol.spread([5.0, 1.0, 3.0, 100.0]) == {"median": 4.0, "min": 1.0, "max": 100.0, "n": 4}
    assert protocol.spread([2.0]) == {"median": 2.0, "min": 2.0, "max": 2.0, "n": 1}
    with pytest.raises(ValueError):
        protocol.spread([])


def _rec(phase, repeat, config, **metrics):
    return {"phase": phase, "repeat": repeat, "config": config, "metrics": metrics}


def test_summarize_discards_warmup_and_skips_missing_values():
    records = [_rec("warmup", 0, "A", x=1000.0), _rec("measure", 0, "A", x=1.0, y=None),
               _rec("measure", 1, "A", x=3.0, y=7.0), _rec("measure", 0, "B", x=10.0)]
    s = protocol.summarize(records)
    assert s["A"]["x"] == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 2}
    assert s["A"]["y"]["n"] == 1
    assert s["B"]["x"]["median"] == 10.0


def test_summarize_flattens_nested_metrics_and_leaves_out_what_is_not_a_number():
    # bench/served.py's runs carry the step thread's phases and the attention kernel's variant as mappings
    # (2026-12-04 on the H200 a whole call's summary was lost to float() of a dict)
    records = [_rec("measure", 0, "A", tok_s=5.0, phases={"build": 0.3, "append": 0.1}, note="text"),
               _rec("measure", 1, "A", tok_s=7.0, phases={"build": 0.5}, attention={"ASYNC": 1}, n=np.int64(3))]
    s = protocol.summarize(records)
    assert s["A"]["tok_s"]["median"] == 6.0
    assert s["A"]["phases.build"] == {"median": 0.4, "min": 0.3, "max": 0.5, "n": 2}
    assert s["A"]["phases.append"]["n"] == 1 and s["A"]["attention.ASYNC"]["median"] == 1.0
    assert "note" not in s["A"] and s["A"]["n"]["median"] == 3.0  # NumPy's integers count as numbers


def test_by_repeat_groups_measured_records():
    records = [_rec("warmup", 0, "A", x=9.0), _rec("measure", 0, "A", x=1.0), _rec("measure", 0, "B", x=2.0),
               _rec("measure", 1, "A", x=3.0)]
    assert protocol.by_repeat(records) == {0: {"A": {"x": 1.0}, "B": {"x": 2.0}}, 1: {"A": {"x": 3.0}}}


async def test_run_follows_the_schedule_marks_warmup_and_keeps_detail():
    calls = []

    def measure(name):
        async def go():
            calls.append(name)
            return {"metrics": {"v": float(len(calls))}, "status_counts": {"200": 1}}
        return go

    records = await protocol.run({"A": measure("A"), "B": measure("B")}, repeats=5, warmup=2, progress=False)
    assert calls == [s.config for s in protocol.schedule(["A", "B"], 5, 2)]
    assert [r["phase"] for r in records].count("warmup") == 4
    assert records[0]["detail"] == {"status_counts": {"200": 1}}
    summary = protocol.summarize(records)
    # the first 4 calls (values 1..4) were warm-up and must not reach the summary
    assert summary["A"]["v"]["min"] >= 5 and summary["B"]["v"]["min"] >= 5
    assert summary["A"]["v"]["n"] == 5


async def test_run_accepts_flat_metrics():
    async def flat():
        return {"v": 1.0}

    records = await protocol.run({"A": flat}, repeats=5, warmup=0, progress=False)
    assert records[0]["metrics"] == {"v": 1.0} and "detail" not in records[0]


def test_markdown_table_shows_median_and_range():
    summary = {"A": {"x": protocol.spread([1.0, 2.0, 4.0])}}
    table = protocol.markdown_table(summary, ["x", "missing"], digits=1)
    assert table.splitlines() == ["| config | x | missing |", "| --- | --- | --- |", "| A | 2.0 (1.0–4.0) | – |"]


def test_command_line_names_module_runs():
    assert protocol.command_line(["/repo/bench/gateway_overhead.py", "--repeats", "5"]) == \
        "python -m bench.gateway_overhead --repeats 5"
    assert protocol.command_line(["/usr/bin/pytest", "a b"]) == "pytest 'a b'"


def test_result_document_and_files(tmp_path):
    records = [_rec("warmup", 0, "A", x=9.0)] + [_rec("measure", r, "A", x=float(r)) for r in range(5)]
    summary = protocol.summarize(records)
    machine = {"cpu": "test cpu", "cores": 2, "loadavg": [0.1, 0.1, 0.1], "git_commit": "abc"}
    doc = protocol.result_document("demo", records, summary, {"k": 1}, started=1.0, machine=machine)
    assert {"benchmark", "command", "machine", "loadavg_end", "params", "started", "finished", "protocol",
            "records", "summary"} <= set(doc)
    assert doc["protocol"]["repeats"] == 5 and doc["protocol"]["warmup"] == 1
    assert doc["machine"]["cpu"] == "test cpu"
    paths = protocol.write_result(doc, protocol.markdown_table(summary, ["x"]), ["x"], tmp_path)
    assert json.loads(paths["json"].read_text())["summary"]["A"]["x"]["median"] == 2.0
    assert "| A |" in paths["md"].read_text()
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_machine_info_reads_this_machine():
    from bench.machine import cpu_model, machine_info

    info = machine_info()
    assert info["cores"] >= 1 and len(info["loadavg"]) == 3 and isinstance(info["gpus"], list)
    assert cpu_model("processor\t: 0\nmodel name\t: Some CPU @ 2GHz\n") == "Some CPU @ 2GHz"
    assert cpu_model("CPU part\t: 0xd4f\n") == "0xd4f"


def test_loops_choose_uvloop_like_ray_unless_asked_for_asyncio():
    import asyncio

    from bench import loops

    pytest.importorskip("uvloop")
    assert loops.resolve("auto") == "uvloop" and loops.resolve("asyncio") == "asyncio"
    assert loops.run(asyncio.sleep(0, result=7), "uvloop") == 7
    with pytest.raises(ValueError):
        loops.new_loop("trio")


def test_a_run_cut_short_keeps_the_records_of_the_runs_that_ended():
    import asyncio

    calls = []

    async def measure():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # what a time limit's SIGINT becomes in the benchmark's loop
        return {"tok_s": float(len(calls))}

    records: list = []
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(protocol.run({"A": measure, "B": measure}, repeats=2, warmup=1, progress=False, records=records))
    assert [(r["phase"], r["config"], r["metrics"]["tok_s"]) for r in records] == [("warmup", "A", 1.0),
                                                                                  ("warmup", "B", 2.0)]
    assert protocol.summarize(records) == {}  # no measured run ended: nothing to summarize, and no error


def test_run_to_limit_keeps_the_runs_that_ended_when_sigint_cuts_it_short():
    """A SIGINT (KeyboardInterrupt) in the third run: the two before it are returned with the line saying so, and
    SIGINT is ignored from then on (a second one while the servers stop would lose the summary)."""
    import signal

    calls = []

    async def measure():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return {"x": 1.0}

    before = signal.getsignal(signal.SIGINT)
    try:
        records, cut = protocol.run_to_limit({"a": measure, "b": measure}, 2, 1, False, "asyncio")
        assert len(records) == 2 and cut == "interrupted after 2 of 6 runs"
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        calls.clear()
        records, cut = protocol.run_to_limit({"a": measure}, 1, 0, False, "asyncio")
        assert len(records) == 1 and cut is None
    finally:
        signal.signal(signal.SIGINT, before)
