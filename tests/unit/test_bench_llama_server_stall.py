"""bench.llama_server_stall's reading of llama-server's log: the tasks launched and never released."""
from __future__ import annotations

from bench.llama_server_stall import stuck_tasks


def test_a_launch_without_its_release_is_stuck():
    log = "\n".join([
        "0.08.771.269 I slot launch_slot_: id  0 | task 56 | processing task, is_child = 0",
        "0.08.771.662 I slot launch_slot_: id  1 | task 57 | processing task, is_child = 0",
        "0.08.805.190 I slot get_availabl: id  1 | task 57 | selected slot by id (1)",
        "0.09.284.572 I slot      release: id  0 | task 56 | stop processing: n_tokens = 36, truncated = 0",
    ])
    assert stuck_tasks(log) == ["slot 1 task 57"]
    assert stuck_tasks(log + "\n0.10.0.0 I slot      release: id  1 | task 57 | stop processing: n_tokens = 3") == []
