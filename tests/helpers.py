"""Shared test helpers (imported by the test modules; pytest puts tests/ on sys.path)."""
import pytest

HEADER = f"{'op':<18} {'quantity':<28} {'max abs':>10} {'max rel':>10} {'tol':>8}"


def format_rows(rows):
    return "\n".join([HEADER] + [r.line() for r in rows])


def assert_rows(rows, context=""):
    """Fail, printing the failing rows (where and how big the largest differences are) and then
    every row, unless every Row passed."""
    rows = list(rows)
    assert rows, "the check returned no rows: nothing was compared"
    failed = [r for r in rows if not r.ok]
    if failed:
        head = f"{len(failed)} of {len(rows)} rows failed" + (f" ({context})" if context else "")
        pytest.fail(f"{head}:\n{format_rows(failed)}\n\nall rows:\n{format_rows(rows)}", pytrace=False)

