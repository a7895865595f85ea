"""Rich renderables for the viewer's panels, as pure functions of records (no Textual here), so
they are testable alone and shared by the TUI and ``legorl inspect --summary``."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.rule import Rule
from rich.style import Style
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from legorl.records import ENVIRONMENT_FAILURES, Sample, Trajectory, Turn

BARS = "▁▂▃▄▅▆▇█"
STATUS_STYLE = {
    "ok": "green",
    "agent_error": "yellow",
    "timeout": "yellow",
    "harness_error": "yellow",
    "running": "cyan",
} | {s: "bold red" for s in ENVIRONMENT_FAILURES}
PROMPT_CHARS = 3000  # decoded prompt delta shown per turn unless expanded


class Decoder:
    """Token ids to text with a model folder's tokenizer (``ChatTokenizer``), single tokens
    cached for the token view."""

    def __init__(self, model_dir: str | Path) -> None:
        from legorl.proxy.tokens import ChatTokenizer

        self.tok = ChatTokenizer(model_dir)
        self._pieces: dict[int, str] = {}

    def text(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids))

    def piece(self, token_id: int) -> str:
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self.tok.decode([token_id])
            self._pieces[token_id] = piece
        return piece


def sparkline(values: Sequence[float], width: int = 40) -> str:
    """The last ``width`` values as a one-line bar chart."""
    vals = [v for v in values if v is not None and math.isfinite(v)][-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    if hi - lo < 1e-12:
        return BARS[len(BARS) // 2] * len(vals)
    return "".join(BARS[round((v - lo) / (hi - lo) * (len(BARS) - 1))] for v in vals)


def fmt(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "–"
    if value == 0 or 1e-3 <= abs(value) < 1e6:
        return f"{value:.{digits}g}"
    return f"{value:.2e}"


# --------------------------------------------------------------------------------------------
# Trajectory detail
# --------------------------------------------------------------------------------------------


def trajectory_header(
    traj: Trajectory, turns: int, source: Path, *, running: bool = False
) -> RenderableType:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    if running:
        status = Text("running (no trajectory record yet)", style="cyan")
    else:
        status = Text(traj.status, style=STATUS_STYLE.get(traj.status, ""))
    table.add_row("trajectory", traj.trajectory_id)
    table.add_row("task", f"{traj.task_id}  (group {traj.group_id}, sample {traj.sample_index})")
    table.add_row("harness", traj.harness)
    table.add_row("status", status)
    table.add_row("reward", fmt(traj.reward))
    flags = Text(", ".join(traj.hack_flags), style="bold red") if traj.hack_flags else Text("none")
    table.add_row("hack flags", flags)
    table.add_row(
        "tokens", f"{traj.tokens.prompt} prompt, {traj.tokens.completion} completion; {turns} turns"
    )
    if traj.timings:
        table.add_row("timings", ", ".join(f"{k} {v:g}" for k, v in traj.timings.items()))
    for key, value in traj.evidence.items():
        shown = value if isinstance(value, str) else json.dumps(value)
        table.add_row(f"evidence.{key}", Text(shown[-600:]))
    table.add_row("file", str(source))
    return table


def _clip(text: str, limit: int | None) -> Text:
    if limit is None or len(text) <= limit:
        return Text(text)
    head = Text(text[:limit])
    head.append(f"\n… {len(text) - limit} more characters (press e to expand)", style="dim italic")
    return head


def turns_renderable(
    turns: list[Turn], decoder: Decoder | None = None, *, expand: bool = False
) -> RenderableType:
    """Each call in order: segment boundaries with their reason, aux sub-sessions marked, the
    prompt delta (decoded when a tokenizer is given) and the completion."""
    if not turns:
        return Text("no turns recorded", style="dim")
    parts: list[RenderableType] = []
    sessions: dict[str, list[Turn]] = {}
    for t in turns:
        sessions.setdefault(t.session, []).append(t)
    main = [s for s, ts in sessions.items() if not ts[0].flags.aux]
    aux = [s for s, ts in sessions.items() if ts[0].flags.aux]
    summary = Text(f"{len(turns)} calls; sessions: ")
    summary.append(", ".join(f"{s} ({len(sessions[s])})" for s in main) or "none")
    if aux:
        summary.append("; aux sub-sessions: ", style="magenta")
        summary.append(", ".join(f"{s} ({len(sessions[s])})" for s in aux), style="magenta")
    parts.append(summary)
    if decoder is None:
        parts.append(
            Text(
                "prompts are token ids: give --model to decode them and the tool results",
                style="dim italic",
            )
        )
    segment_of: dict[str, int] = {}
    limit = None if expand else PROMPT_CHARS
    for t in turns:
        aux_tag = " · aux" if t.flags.aux else ""
        if segment_of.get(t.session) != t.segment:
            segment_of[t.session] = t.segment
            reason = t.segment_reason or ("start" if t.segment == 0 else "?")
            parts.append(
                Rule(
                    f"{t.session}{aux_tag} · segment {t.segment} · {reason}",
                    style="magenta" if t.flags.aux else "cyan",
                )
            )
        head = Text(f"turn {t.turn}", style="bold")
        head.append(f"  {t.api} · policy v{t.policy_version} · {t.finish_reason}", style="dim")
        if t.parent_session:
            head.append(f" · sub-session of {t.parent_session}", style="magenta")
        if t.flags.realigned:
            head.append(f" · realigned {t.flags.realigned}", style="yellow")
        if t.flags.malformed_tool_call:
            head.append(" · malformed tool call", style="bold red")
        gen = t.timings.get("generate_s")
        if gen is not None:
            head.append(f" · {gen:.2f}s", style="dim")
        parts.append(head)
        prompt = Text("  prompt ", style="blue")
        prompt.append(f"+{len(t.prompt_delta)} tokens at offset {t.prompt_offset}", style="dim")
        parts.append(prompt)
        if decoder is not None and t.prompt_delta:
            parts.append(_indent(_clip(decoder.text(t.prompt_delta), limit), "blue"))
        parts.append(Text(f"  completion {len(t.completion_ids)} tokens", style="green"))
        if decoder is not None:
            parts.append(_indent(_clip(decoder.text(t.completion_ids), limit), "green"))
        else:
            out = t.output
            if out.thinking:
                parts.append(_indent(Text(out.thinking, style="italic"), "green", "thinking"))
            if out.text:
                parts.append(_indent(Text(out.text), "green", "text"))
        for call in t.output.tool_calls:
            line = Text("    → ", style="yellow")
            line.append(call.name, style="bold yellow")
            line.append(f"({call.arguments})  ", style="yellow")
            line.append(call.id, style="dim")
            parts.append(line)
    return Group(*parts)


def _indent(text: Text, colour: str, label: str | None = None) -> Text:
    out = Text()
    if label:
        out.append(f"    {label}: ", style=f"dim {colour}")
        out.append("\n")
    for i, line in enumerate(text.split("\n", allow_blank=True)):
        if i:
            out.append("\n")
        out.append("    │ ", style=colour)
        out.append_text(line)
    return out


def patch_renderable(patch: str) -> RenderableType:
    if not patch.strip():
        return Text("(empty patch)", style="dim")
    return Syntax(patch, "diff", theme="ansi_dark", word_wrap=True, background_color="default")


_PASS = {"passed", "pass", "success", "ok", "xfail", "resolved", "true"}
_FAIL = {"failed", "fail", "failure", "error", "errored", "false"}


def verdict_tests(verdict: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(group, test, status) rows found anywhere in a verdict: SWE-bench's
    ``{group: {success: [...], failure: [...]}}``, ``{test: "PASSED"}`` maps, and lists of
    ``{"name": …, "status": …}``."""
    rows: list[tuple[str, str, str]] = []

    def walk(value: Any, group: str) -> None:
        if isinstance(value, dict):
            if any(k in value for k in ("success", "failure")) and all(
                isinstance(v, list) for v in value.values()
            ):
                for key, tests in value.items():
                    status = {"success": "passed", "failure": "failed"}.get(key, str(key))
                    rows.extend((group, str(test), status) for test in tests)
                return
            if value and all(
                isinstance(v, str) and v.lower() in _PASS | _FAIL | {"skipped"}
                for v in value.values()
            ):
                rows.extend((group, str(k), v.lower()) for k, v in value.items())
                return
            for key, sub in value.items():
                walk(sub, f"{group}.{key}" if group else str(key))
        elif isinstance(value, list):
            for item in value:
                if (
                    isinstance(item, dict)
                    and "name" in item
                    and ("status" in item or "outcome" in item)
                ):
                    rows.append(
                        (
                            group,
                            str(item["name"]),
                            str(item.get("status", item.get("outcome"))).lower(),
                        )
                    )

    walk(verdict, "")
    return rows


def verdict_renderable(verdict: dict[str, Any] | None) -> RenderableType:
    if verdict is None:
        return Text("not verified yet", style="dim")
    parts: list[RenderableType] = []
    scalars = Table.grid(padding=(0, 2))
    scalars.add_column(style="bold")
    scalars.add_column()
    for key, value in verdict.items():
        if not isinstance(value, (dict, list)):
            style = "green" if value is True else "red" if value is False else ""
            scalars.add_row(key, Text(str(value), style=style))
    if scalars.row_count:
        parts.append(scalars)
    tests = verdict_tests(verdict)
    if tests:
        table = Table("group", "test", "result", expand=True, show_edge=False)
        for group, test, status in tests:
            style = "green" if status in _PASS else "red" if status in _FAIL else "yellow"
            mark = "✓" if status in _PASS else "✗" if status in _FAIL else "·"
            table.add_row(group, test, Text(f"{mark} {status}", style=style))
        parts.append(table)
    else:
        rest = {k: v for k, v in verdict.items() if isinstance(v, (dict, list))}
        if rest:
            parts.append(Syntax(json.dumps(rest, indent=2), "json", theme="ansi_dark"))
    return Group(*parts) if parts else Text("(empty verdict)", style="dim")


# --------------------------------------------------------------------------------------------
# Token view
# --------------------------------------------------------------------------------------------


def _ramp(t: float) -> Style:
    """0 → green, 0.5 → yellow, 1 → red, as a background behind black text."""
    t = min(1.0, max(0.0, t))
    if t < 0.5:
        r, g = int(80 + 350 * t), 200
    else:
        r, g = 255, int(200 - 340 * (t - 0.5))
    return Style(color="black", bgcolor=f"rgb({min(r, 255)},{max(g, 40)},60)")


def logprob_badness(lp: float) -> float:
    """How unlikely a sampled token was: 1 - p."""
    return 1.0 - math.exp(min(0.0, lp))


def delta_badness(delta: float) -> float:
    """|Δ log-prob| on a log scale: <= 1e-4 is 0, >= 0.5 is 1."""
    if delta <= 1e-4:
        return 0.0
    return min(1.0, math.log10(delta / 1e-4) / math.log10(0.5 / 1e-4))


MASKED = Style(color="grey50", italic=True)


ROUTED_ELSEWHERE = Style(color="white", bgcolor="magenta", bold=True)
ROUTED_SAME = Style(color="black", bgcolor="rgb(80,200,60)")


def token_text(
    sample: Sample,
    decoder: Decoder | None,
    trainer_logprobs: Sequence[float] | None = None,
    mode: str = "logprob",
    routing_differs: Sequence[int] | None = None,
) -> Text:
    """The sample's tokens: prompt and tool-result tokens (loss mask 0) grey; sampled tokens on
    a background coloured by rollout log-prob (``mode="logprob"``) or by |rollout − trainer|
    (``mode="delta"``, when trainer log-probs are given). ``mode="routing"`` (a MoE sample with
    ``routing_differs``): every token whose experts the trainer's router chose otherwise than
    the rollout's on magenta, the sampled others green."""
    out = Text()
    k = 0
    use_delta = (
        mode == "delta"
        and trainer_logprobs is not None
        and len(trainer_logprobs) == len(sample.rollout_logprobs)
    )
    differs = set(routing_differs) if mode == "routing" and routing_differs is not None else None
    for position, (token_id, mask) in enumerate(
        zip(sample.input_ids, sample.loss_mask, strict=True)
    ):
        piece = decoder.piece(token_id) if decoder is not None else f"⟨{token_id}⟩"
        shown = piece.replace("\t", "→").replace("\n", "↵\n")
        if differs is not None:
            k += mask
            style = ROUTED_ELSEWHERE if position in differs else ROUTED_SAME if mask else MASKED
            out.append(shown, style=style)
            continue
        if not mask:
            out.append(shown, style=MASKED)
            continue
        lp = sample.rollout_logprobs[k]
        if use_delta:
            assert trainer_logprobs is not None
            style = _ramp(delta_badness(abs(lp - trainer_logprobs[k])))
        else:
            style = _ramp(logprob_badness(lp))
        out.append(shown, style=style)
        k += 1
    return out


def token_legend(mode: str, has_trainer: bool) -> Text:
    legend = Text()
    legend.append("prompt / tool output (not trained)", style=MASKED)
    legend.append("   ")
    if mode == "routing":
        legend.append(" routed elsewhere by the trainer ", style=ROUTED_ELSEWHERE)
        legend.append(" ")
        legend.append(" same experts ", style=ROUTED_SAME)
        legend.append("   (r: back to log-probs)", style="dim")
        return legend
    if mode == "delta" and has_trainer:
        legend.append("|Δ log-prob| ", style="bold")
        for label, t in (
            ("≤1e-4", 0.0),
            ("1e-3", 0.27),
            ("1e-2", 0.54),
            ("0.1", 0.81),
            ("≥0.5", 1.0),
        ):
            legend.append(f" {label} ", style=_ramp(t))
    else:
        legend.append("rollout p ", style="bold")
        for label, t in (("1.0", 0.0), ("0.75", 0.25), ("0.5", 0.5), ("0.25", 0.75), ("0", 1.0)):
            legend.append(f" {label} ", style=_ramp(t))
        if has_trainer:
            legend.append("   (d: colour by |Δ log-prob|)", style="dim")
        else:
            legend.append("   (no trainer log-probs for this sample)", style="dim")
    return legend


def token_stats(sample: Sample, trainer_logprobs: Sequence[float] | None) -> Text:
    from legorl.monitors import prob_pearson

    lps = sample.rollout_logprobs
    n = len(lps)
    text = Text()
    text.append(f"{sample.sample_id}", style="bold")
    text.append(
        f"  episode {sample.episode_id} · segment {sample.segment_index + 1}/{sample.segment_count}"
        f" · {len(sample.input_ids)} tokens, {n} trained · reward {fmt(sample.reward)}"
        f" · advantage {fmt(sample.advantage)} · policy v{sample.policy_version}"
    )
    if sample.aux:
        text.append(" · aux", style="magenta")
    if n:
        text.append(f"\nrollout log-prob: mean {sum(lps) / n:.3f}, min {min(lps):.3f}")
    if trainer_logprobs is not None:
        if len(trainer_logprobs) != n:
            text.append(
                f"\ntrainer log-probs: {len(trainer_logprobs)} values for {n} loss tokens "
                "(ignored)",
                style="red",
            )
        elif n:
            deltas = [abs(a - b) for a, b in zip(lps, trainer_logprobs, strict=True)]
            corr = prob_pearson(lps, trainer_logprobs)
            style = "green" if corr is not None and corr >= 0.99 else "bold red"
            text.append("\ntrainer: Pearson(prob) ")
            text.append(fmt(corr, 6), style=style)
            text.append(f", max |Δ| {max(deltas):.2e}, mean |Δ| {sum(deltas) / n:.2e}")
    return text
