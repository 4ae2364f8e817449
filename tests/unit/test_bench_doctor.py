"""pulse doctor's findings on tables of readings, and its /proc and nvidia-smi parsers."""
import pytest

from pulse import doctor
from pulse.doctor import Finding, GpuProcess, Proc, Readings

CLEAN = dict(cores=4, loadavg=(0.2, 0.3, 0.3), mem_total_kib=16 * 2**20, mem_available_kib=12 * 2**20,
             swap_total_kib=0, swap_free_kib=0, psi_memory_some_avg10=0.0, psi_memory_full_avg10=0.0,
             governors=["performance"] * 4, gpu_processes=[], top_processes=[Proc(1, "idle", 1.0)])


def readings(**over):
    return Readings(**{**CLEAN, **over})


def test_a_clean_machine_has_no_warnings():
    found = doctor.findings(readings())
    assert all(f.ok for f in found), found
    assert doctor.exit_code(found) == 0


@pytest.mark.parametrize("over,check", [
    (dict(gpu_processes=[GpuProcess(42, "python", 1200.0)]), "gpu processes"),
    (dict(loadavg=(1.3, 1.0, 1.0)), "load average"),  # 1.3 > 0.3 * 4
    (dict(mem_available_kib=1 * 2**20), "memory available"),
    (dict(psi_memory_some_avg10=4.5), "memory pressure"),
    (dict(swap_total_kib=4 * 2**20, swap_free_kib=3 * 2**20), "swap"),
    (dict(governors=["performance", "powersave"]), "cpu governor"),
    (dict(top_processes=[Proc(7, "cc1", 95.0), Proc(8, "bash", 2.0)]), "busy processes"),
])
def test_each_spoiler_warns_on_its_own_check(over, check):
    found = doctor.findings(readings(**over))
    bad = [f.check for f in found if f.ok is False]
    assert bad == [check]
    assert doctor.exit_code(found) == 1


@pytest.mark.parametrize("over,check", [
    (dict(gpu_processes=None), "gpu processes"),
    (dict(governors=None), "cpu governor"),
    (dict(psi_memory_some_avg10=None, psi_memory_full_avg10=None), "memory pressure"),
    (dict(loadavg=None), "load average"),
])
def test_unreadable_is_unknown_not_a_warning(over, check):
    found = {f.check: f for f in doctor.findings(readings(**over))}
    assert found[check].ok is None
    assert doctor.exit_code(list(found.values())) == 0


def test_thresholds_at_the_edges():
    assert doctor.check_load(readings(loadavg=(1.2, 0, 0))).ok  # exactly 0.3 per core is still fine
    assert doctor.check_swap(readings(swap_total_kib=2**20, swap_free_kib=2**20 - 200 * 1024)).ok
    assert doctor.check_processes(readings(top_processes=[Proc(1, "x", 19.9)])).ok


def test_parsers():
    mem = doctor.parse_meminfo("MemTotal:       24684084 kB\nMemAvailable:   23430120 kB\nHugePages_Total:       0\n")
    assert mem == {"MemTotal": 24684084, "MemAvailable": 23430120, "HugePages_Total": 0}
    psi = doctor.parse_psi("some avg10=1.50 avg60=0.00 avg300=0.00 total=10\nfull avg10=0.25 avg60=0 avg300=0 total=1\n")
    assert psi == {"some": 1.5, "full": 0.25}
    gpus = doctor.parse_gpu_apps("1234, python3, 20480\n99, /usr/bin/llama-server, [N/A]\n")
    assert gpus == [GpuProcess(1234, "python3", 20480.0), GpuProcess(99, "/usr/bin/llama-server", 0.0)]
    assert doctor.parse_gpu_apps("") == []


def test_cpu_percent_from_two_samples():
    before = {1: ("a", 100), 2: ("b", 0), 3: ("me", 0)}
    after = {1: ("a", 150), 2: ("b", 10), 3: ("me", 500), 4: ("new", 5)}
    procs = doctor.cpu_percent(before, after, seconds=0.5, hz=100, exclude={3})
    assert [(p.name, p.cpu_percent) for p in procs] == [("a", 100.0), ("b", 20.0)]


def test_table_lists_every_check_with_status():
    text = doctor.table([Finding("load average", False, "9 on 2 cores", "busy"), Finding("swap", True, "no swap"),
                         Finding("gpu processes", None, "no nvidia-smi")])
    lines = text.splitlines()
    assert lines[0].split() == ["check", "status", "value", "note"]
    assert "WARN" in lines[1] and "busy" in lines[1] and "ok" in lines[2] and "unknown" in lines[3]


def test_doctor_main_runs_on_this_machine(capsys):
    rc = doctor.doctor_main(["--sample", "0.1"])
    out = capsys.readouterr().out
    assert rc in (0, 1) and "load average" in out and "memory available" in out
