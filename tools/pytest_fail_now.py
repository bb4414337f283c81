"""A pytest plugin for the GPU run (tools/gpu_check.py): print each failure's traceback the moment
it is reported, not in the summary at the end, so a run stopped at its time limit still says why
each test failed. Load with `-p pytest_fail_now` and tools/ on PYTHONPATH; under pytest-xdist the
controller receives every worker's reports, so one copy prints them all."""


def pytest_runtest_logreport(report):
    if report.failed:
        print(f"\n--- FAILED NOW {report.nodeid} ({report.when}) ---\n{report.longreprtext}\n--- end ---", flush=True)
