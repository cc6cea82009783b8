"""The default compile pipeline and its options."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from stepgraph.passes.manager import Pass

PASS_ORDER = ("shard", "pack", "fuse", "bin", "schedule", "pdl", "alias")


@dataclass(frozen=True)
class CompileOptions:
    """Options of the whole pipeline: ``pdl`` turns the PDL + prefetch pass off (ablation);
    ``pack`` turns projection packing off; ``fuse`` turns the AttnRes residual fusion off."""

    pdl: bool = True
    pack: bool = True
    fuse: bool = True

    def to_json(self) -> dict[str, bool]:
        """The options as JSON-able data (part of the artifact hash)."""
        return asdict(self)


def default_pipeline(options: CompileOptions) -> list[Pass]:
    """The passes in order: shard, pack, fuse, bin, schedule, pdl, alias."""
    from stepgraph.passes.alias import Alias
    from stepgraph.passes.bin import Bin
    from stepgraph.passes.fuse import Fuse
    from stepgraph.passes.pack import Pack
    from stepgraph.passes.pdl import Pdl
    from stepgraph.passes.schedule import Schedule
    from stepgraph.passes.shard import Shard

    return [
        Shard(),
        Pack(enabled=options.pack),
        Fuse(enabled=options.fuse),
        Bin(),
        Schedule(),
        Pdl(enabled=options.pdl),
        Alias(),
    ]
