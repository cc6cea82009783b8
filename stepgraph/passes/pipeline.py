"""The default compile pipeline and its options."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from stepgraph.passes.manager import Pass

PASS_ORDER = ("shard", "pack", "fuse", "bin", "schedule", "streams", "pdl", "alias")


@dataclass(frozen=True)
class CompileOptions:
    """Options of the whole pipeline: ``pdl`` turns the PDL + prefetch pass off (ablation);
    ``pack`` turns projection packing off; ``fuse`` turns the AttnRes residual fusion off;
    ``streams`` keeps every launch on one stream."""

    pdl: bool = True
    pack: bool = True
    fuse: bool = True
    streams: bool = True

    def to_json(self) -> dict[str, bool]:
        """The options as JSON-able data (part of the artifact hash)."""
        return asdict(self)


def default_pipeline(options: CompileOptions) -> list[Pass]:
    """The passes in order: shard, pack, fuse, bin, schedule, streams, pdl, alias."""
    from stepgraph.passes.alias import Alias
    from stepgraph.passes.bin import Bin
    from stepgraph.passes.fuse import Fuse
    from stepgraph.passes.pack import Pack
    from stepgraph.passes.pdl import Pdl
    from stepgraph.passes.schedule import Schedule
    from stepgraph.passes.shard import Shard
    from stepgraph.passes.streams import Streams

    return [
        Shard(),
        Pack(enabled=options.pack),
        Fuse(enabled=options.fuse),
        Bin(),
        Schedule(),
        Streams(enabled=options.streams),
        Pdl(enabled=options.pdl),
        Alias(),
    ]
