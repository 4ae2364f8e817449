from workers.ray_env import SERVING_ENV, quiet_control_plane, serving_runtime_env


def test_serving_runtime_env_sets_nice_0_and_keeps_the_callers_variables():
    assert SERVING_ENV == {"RAY_worker_niceness": "0"}
    assert serving_runtime_env() == {"env_vars": {"RAY_worker_niceness": "0"}}
    env = serving_runtime_env({"PROMETHEUS_MULTIPROC_DIR": "/tmp/m"})
    assert env == {"env_vars": {"RAY_worker_niceness": "0", "PROMETHEUS_MULTIPROC_DIR": "/tmp/m"}}
    serving_runtime_env()["env_vars"]["X"] = "1"  # a caller's copy, not the shared constant
    assert SERVING_ENV == {"RAY_worker_niceness": "0"}


def test_quiet_control_plane_sets_defaults_and_keeps_an_explicit_setting():
    env: dict = {}
    quiet_control_plane(env)
    assert env == {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1", "RAY_prestart_worker_first_driver": "0"}
    env = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1", "RAY_prestart_worker_first_driver": "1"}
    quiet_control_plane(env)
    assert env == {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1", "RAY_prestart_worker_first_driver": "1"}
