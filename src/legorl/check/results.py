"""What a check returns: a named pass, fail (with its fix) or skip."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["pass", "fail", "skip"]


@dataclass(slots=True, kw_only=True)
class CheckResult:
    name: str
    status: Status
    reason: str
    fix: str = ""

    @property
    def ok(self) -> bool:
        return self.status != "fail"


def _pass(name: str, reason: str) -> CheckResult:
    return CheckResult(name=name, status="pass", reason=reason)


def _fail(name: str, reason: str, fix: str) -> CheckResult:
    return CheckResult(name=name, status="fail", reason=reason, fix=fix)


def _skip(name: str, reason: str) -> CheckResult:
    return CheckResult(name=name, status="skip", reason=reason)


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"
