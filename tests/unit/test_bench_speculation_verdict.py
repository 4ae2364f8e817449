"""bench/speculation's verdicts pair the adaptive and the best configuration per repeat."""
from bench.speculation import grid_notes, paired_verdict


def test_a_match_needs_the_paired_ratios_to_reach_one():
    assert paired_verdict([0.99, 1.01, 1.02]).startswith("matches")
    assert paired_verdict([0.98, 0.975, 0.99]).startswith("matches")  # within 3%
    # overlapping min-max ranges of two configurations used to be called a match at 0.90x
    assert paired_verdict([0.88, 0.90, 0.92]) == "0.90x (0.88-0.92)"
    assert paired_verdict([1.2, 1.3, 1.25]) == "1.25x (1.20-1.30)"


def test_grid_notes_pair_per_repeat():
    def rec(repeat, config, tok_s):
        return {"phase": "measure", "repeat": repeat, "config": config, "metrics": {"decode_tok_s": tok_s}}

    # repeat 0 is slow for everything, repeat 1 fast: unpaired ranges overlap, paired ratios are 0.8
    records = [rec(0, "L256-C1-off", 100), rec(0, "L256-C1-k2", 50), rec(0, "L256-C1-adaptive", 80),
               rec(1, "L256-C1-off", 200), rec(1, "L256-C1-k2", 90), rec(1, "L256-C1-adaptive", 160)]
    summary = {f"L256-C1-{n}": {"decode_tok_s": {"median": m, "min": lo, "max": hi}}
               for n, m, lo, hi in (("off", 150, 100, 200), ("k2", 70, 50, 90), ("adaptive", 120, 80, 160))}
    table = grid_notes(records, summary, [256], [1], [2])
    assert "| 256 | 1 | 150.0 | 70.0 | 120.0 | off | 0.80x (0.80-0.80) |" in table


def test_each_configuration_keeps_its_speculator_across_runs():
    """grid/edit runs of one configuration share a Speculator (its gate and acceptance prior warm after the warm-up,
    as in a server); without `kept` every call makes a new one (a cold start)."""
    from types import SimpleNamespace

    from bench.speculation import fixed_k, set_policy

    eng, prof, kept = SimpleNamespace(speculator=None), fixed_k(2), {}
    set_policy(eng, prof, kept, ("L64", "C1", "k2"))
    first = eng.speculator
    set_policy(eng, None, kept, "off")
    assert eng.speculator is None
    set_policy(eng, prof, kept, ("L64", "C1", "k2"))
    assert eng.speculator is first
    set_policy(eng, prof, kept, ("L64", "C2", "k2"))
    assert eng.speculator is not first
    set_policy(eng, prof)
    assert eng.speculator is not first and eng.speculator is not kept[("L64", "C2", "k2")]
