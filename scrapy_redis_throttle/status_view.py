"""What ``scrapy-redis-throttle status`` and ``get`` show of the fleet's state in Redis: one
row per domain (the limit in force and where it is set, the tokens left, what the fleet sent
and has waiting, a pause, the adaptive rate), as a table or as JSON."""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Any

from .control import FleetActivity
from .rates import format_rate

if TYPE_CHECKING:
    import argparse

    from .config import ThrottleConfig
    from .control import DomainState, LiveControl
    from .rates import Limit

UNREADABLE_NOTE = "ignored, unreadable in Redis: "


def as_json(value: object) -> str:
    return json.dumps(value, sort_keys=True)


def show(control: LiveControl, config: ThrottleConfig, args: argparse.Namespace) -> None:
    """``status``: the table (or JSON) once, or every ``--watch`` seconds until Ctrl-C."""
    while True:
        activity = control.activity()
        workers = control.fleet_workers()
        domains = sorted(set(control.active_domains()) | set(activity))
        states = control.states(domains[: args.top])
        rows = domain_rows(states, config, args.in_project, activity)
        if args.json:
            more = len(domains) - len(rows)
            print(
                as_json(
                    {
                        "workers": workers,
                        "domains": rows,
                        "more": more,
                        "unreadable": control.problems,
                    }
                )
            )
            control.problems.clear()
            if args.watch is None:
                return
            sys.stdout.flush()
            time.sleep(args.watch)
            continue
        live = f"{workers} worker{'' if workers == 1 else 's'} live"
        table = f"{live}\n" + (render_table(rows) if rows else "No active domain.")
        if len(domains) > args.top:
            table += f"\n... and {len(domains) - args.top} more (--top)"
        # Under the table each time: a watch ends only with Ctrl-C.
        table += "".join(f"\n{UNREADABLE_NOTE}{problem}" for problem in control.problems)
        control.problems.clear()
        if args.watch is None:
            print(table)
            return
        # Clear the screen, then the table: a live view.
        print(
            f"\033[H\033[J{time.strftime('%H:%M:%S')}  {len(domains)} active\n{table}", flush=True
        )
        time.sleep(args.watch)


def domain_rows(
    states: list[DomainState],
    config: ThrottleConfig,
    in_project: bool,
    activity: dict[str, FleetActivity],
) -> list[dict[str, Any]]:
    """Each domain's state, as ``status --json`` prints it (times in seconds, rates per second;
    None: not known here)."""
    rows = []
    covers = config.scope.wildcards_cover_domains
    for state in states:
        fleet = activity.get(state.domain, FleetActivity(0, 0, 0))
        code = config.limits.lookup(state.domain, covers) if in_project else None
        limit = code if state.live is None else state.live.over(code)
        shown = state.live or code
        rows.append(
            {
                "domain": state.domain,
                "limit": str(shown) if shown else None,
                "set": "live" if state.live else _code_or_invalid(state, code),
                "paused": bool(state.live and state.live.paused),
                "rate": None if limit is None else limit.rate,
                "burst": None if limit is None else limit.burst,
                "tokens_left": (
                    None if limit is None else max(0.0, limit.burst - state.full_in * limit.rate)
                ),
                "full_in": state.full_in,
                "last_minute": fleet.went,
                "achieved_rate": fleet.achieved_rate,
                "waiting": fleet.waiting,
                "penalty_pause": state.penalty_pause,
                "strikes": state.strikes,
                "adaptive_rate": state.adaptive_rate,
            }
        )
    return rows


def _code_or_invalid(state: DomainState, code: Limit | None) -> str | None:
    """Where the limit in force comes from when none is set live: ``"invalid live"`` for a live
    limit with a field that is no limit (the workers ignore that field)."""
    if state.live_invalid:
        return "invalid live"
    return "code" if code else None


def render_table(rows: list[dict[str, Any]]) -> str:
    header = (
        "domain",
        "limit",
        "set",
        "tokens left",
        "full in",
        "last minute",
        "achieved",
        "waiting",
        "penalty pause",
        "adaptive",
    )
    lines = [header]
    for row in rows:
        tokens, pause, adaptive = row["tokens_left"], row["penalty_pause"], row["adaptive_rate"]
        lines.append(
            (
                row["domain"],
                row["limit"] or "?",
                row["set"] or "-",
                "?" if tokens is None else f"{tokens:.1f}",
                f"{row['full_in']:.1f} s",
                str(row["last_minute"]),
                format_rate(row["achieved_rate"]) if row["achieved_rate"] else "-",
                str(row["waiting"]),
                f"{pause:.1f} s (x{row['strikes']})" if pause else "-",
                format_rate(adaptive) if adaptive else "-",
            )
        )
    widths = [max(len(line[n]) for line in lines) for n in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )
