"""bench.gateway_hotpath runs each piece both ways and prints one line per case."""
from bench import gateway_hotpath


def test_runs_every_case(capsys):
    assert gateway_hotpath.main(["--repeats", "1", "--n", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0] for line in lines] == list(gateway_hotpath.cases())
    assert all("us CPU per request" in line for line in lines)
