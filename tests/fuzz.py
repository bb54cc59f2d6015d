"""Running schemathesis over every operation of a live server's /openapi.json, valid and invalid requests
alike, a bounded number of each, collecting what failed instead of stopping at the first."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error


@dataclass
class FuzzReport:
    sent: Counter[str] = field(default_factory=Counter)        # requests per operation
    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{sum(self.sent.values())} requests over {len(self.sent)} operations; "
                f"statuses {dict(sorted(self.statuses.items()))}; {len(self.failures)} failures")


def _fuzz_operation(op: Any, mode: GenerationMode, examples: int, checks: list, headers: dict | None,
                    report: FuzzReport) -> None:
    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    def run(case: Any) -> None:
        report.sent[op.label] += 1
        response = case.call_and_validate(headers=headers, timeout=60, checks=[not_a_server_error, *checks])
        report.statuses[response.status_code] += 1

    try:
        run()
    except Unsatisfiable:
        pass  # no invalid request exists for a route without parameters or body
    except Exception as exc:  # noqa: BLE001 - every operation is tried; all failures are reported together
        report.failures.append(f"{op.label} ({mode.value}): {str(exc)[:1500]}")


def fuzz(schema: Any, examples: int, checks: list, headers: dict | None = None) -> FuzzReport:
    report = FuzzReport()
    for result in schema.get_all_operations():
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz_operation(result.ok(), mode, examples, checks, headers, report)
    return report
