from workers.ray_env import SERVING_ENV, serving_runtime_env


def test_serving_runtime_env_sets_nice_0_and_keeps_the_callers_variables():
    assert SERVING_ENV == {"RAY_worker_niceness": "0"}
    assert serving_runtime_env() == {"env_vars": {"RAY_worker_niceness": "0"}}
    env = serving_runtime_env({"PROMETHEUS_MULTIPROC_DIR": "/tmp/m"})
    assert env == {"env_vars": {"RAY_worker_niceness": "0", "PROMETHEUS_MULTIPROC_DIR": "/tmp/m"}}
    serving_runtime_env()["env_vars"]["X"] = "1"  # a caller's copy, not the shared constant
    assert SERVING_ENV == {"RAY_worker_niceness": "0"}
