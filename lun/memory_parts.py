"""The memory plan's table: the parts a run holds per rank (`Part`), the budgets they must
fit (`MemoryPlan`) and its refusal (`MemoryPlanError`). `lun.memory` measures and fills it;
`lun.memory_quant` adds a quantized base's parts and imports only this module of the two
(lun.memory calls it: no import circle)."""

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lun.config import ConfigError

GiB = 2**30
DEVICE, HOST = "device", "host"
# Parts held only at some moments; everything else is held throughout training.
ACTIVATIONS, GRADIENTS, CHECKPOINT_SAVE, CHECKPOINT_READ, EMA_STAGING = (
    "activations",
    "gradients",
    "checkpoint save",
    "checkpoint read",
    "EMA staging",
)
# A plan whose peak takes more than this share of a budget is printed as the whole table (the
# parts say what to shrink); below it one line, and `main.py --plan` shows the table.
TIGHT = 0.8


class MemoryPlanError(ConfigError):
    """The plan does not fit the machine: one line saying by how much and what would fit."""


@dataclass
class Part:
    name: str
    nbytes: int  # per rank
    place: str  # DEVICE or HOST
    detail: str = ""


@dataclass
class MemoryPlan:
    """The parts a run holds, per rank, and the budgets they must fit.

    `device` is where training runs ("cpu": its parts are host RAM); `local_ranks` the processes
    on this machine, each holding its own host parts.
    """

    parts: list[Part]
    device: str
    local_ranks: int = 1
    host_budget: int | None = None
    device_budget: int | None = None
    options: list[dict] = field(default_factory=list)  # what would shrink it (see `_options`)

    def _sum(self, place: str, leave_out=()) -> int:
        per_rank = sum(p.nbytes for p in self.parts if p.place == place and p.name not in leave_out)
        return per_rank * (self.local_ranks if place == HOST else 1)

    def peaks(self, place: str) -> dict[str, int]:
        """Training, saving and resuming peak of `place` (device: per device; host: machine)."""
        return {
            "training": self._sum(place, {CHECKPOINT_SAVE, CHECKPOINT_READ}),
            "saving": self._sum(place, {ACTIVATIONS, CHECKPOINT_READ}),
            # The EMA's staging buffers are first written by its first update, after the restore
            # (pages of an empty tensor are not resident until written).
            "resuming": self._sum(place, {ACTIVATIONS, GRADIENTS, CHECKPOINT_SAVE, EMA_STAGING}),
        }

    def peak(self, place: str) -> int:
        return max(self.peaks(place).values())

    def places(self) -> list[str]:
        return [HOST] if self.device == "cpu" else [DEVICE, HOST]

    def table(self) -> str:
        places = self.places()
        where = "host RAM" if self.device == "cpu" else f"{self.device} and host RAM"
        ranks = f", {self.local_ranks} processes on this machine" if self.local_ranks > 1 else ""
        header = f"memory plan ({where}, per rank{ranks}):"
        rows = []
        for p in self.parts:
            cells = [_gib(p.nbytes) if p.place == place else "" for place in places]
            rows.append((p.name, cells, p.detail))
        for label in ("training", "saving", "resuming"):
            cells = [_gib(self.peaks(place)[label]) for place in places]
            budgets = [self.host_budget if pl == HOST else self.device_budget for pl in places]
            limit = ", ".join(f"{pl} {_gib(b)}" for pl, b in zip(places, budgets) if b)
            note = "the machine" + ("" if self.local_ranks == 1 else " (all its processes)")
            rows.append((f"= {label} peak", cells, f"of {note}: {limit}" if limit else ""))
        width = max(len(r[0]) for r in rows) + 2
        heads = "".join(f"{'device' if pl == DEVICE else 'host':>11}" for pl in places)
        lines = [header, f"  {'':<{width}}{heads}"]
        for name, cells, detail in rows:
            lines.append(f"  {name:<{width}}" + "".join(f"{c:>11}" for c in cells) + f"  {detail}")
        return "\n".join(line.rstrip() for line in lines)

    def budget(self, place: str) -> int | None:
        return self.host_budget if place == HOST else self.device_budget

    def tight(self) -> bool:
        """A peak over TIGHT of its budget: worth the whole table."""
        return any(
            self.budget(pl) and self.peak(pl) > TIGHT * self.budget(pl) for pl in self.places()
        )

    def line(self) -> str:
        """The plan in one line: each place's peak and its budget."""
        peaks = []
        for place in self.places():
            what = "host RAM" if place == HOST else f"{self.device} memory"
            budget = self.budget(place)
            peaks.append(
                f"{_gib(self.peak(place))} {what}" + (f" of {_gib(budget)}" if budget else "")
            )
        return f"memory plan: peak {', '.join(peaks)} (--plan shows the parts)"

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "peaks": {place: self.peaks(place) for place in self.places()},
        }

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    def check(self) -> None:
        """Raise MemoryPlanError (one line) when a peak exceeds its budget."""
        for place, budget in ((DEVICE, self.device_budget), (HOST, self.host_budget)):
            if place not in self.places() or not budget or self.peak(place) <= budget:
                continue
            need = self.peak(place)
            what = "host RAM" if place == HOST else f"{self.device} memory"
            flag = "--host-memory" if place == HOST else "--device-memory"
            fits = [o for o in self.options if need - o["saves"].get(place, 0) <= budget]
            others = [o for o in self.options if o not in fits and o["saves"].get(place, 0) > 0]
            if fits:
                advice = "it would fit with " + " or ".join(_option(o, place) for o in fits)
            elif others:
                together = sum(o["saves"].get(place, 0) for o in others)
                advice = "these together save " + _gib(together) + ": "
                advice += ", ".join(_option(o, place) for o in others)
            else:
                advice = "no option here shrinks it enough; use a machine with more memory"
            raise MemoryPlanError(
                f"memory plan: the run needs {_gib(need)} of {what}, the limit is {_gib(budget)}; "
                f"{advice} ({flag} GIB sets the limit)"
            )


def _gib(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / 2**20:.1f} MiB"


def _option(option: dict, place: str) -> str:
    return f"{option['name']} ({option['how']}, -{_gib(option['saves'][place])})"


# --- the parts ------------------------------------------------------------------------------
