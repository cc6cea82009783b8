import sys
from pathlib import Path
from stepgraph.artifact import write_artifact
from stepgraph.compiler import compile_document
from stepgraph.runtime.launch import launch
from stepgraph.runtime.rank_check import RankCheckOptions, check_rank, format_checks
from stepgraph.spec_loader import load_spec, override_deployment
if __name__ == "__main__":
    spec = load_spec("models/tiny_k3.yaml")
    dep = eval(sys.argv[1]); dtype = sys.argv[2]; target = sys.argv[3]
    doc, _ = compile_document(spec, override_deployment(spec.deployment, target=target, batches=(1,2,4), **dep))
    write_artifact(doc, "/tmp/dbg.sgart")
    checks = launch(check_rank, 2, "/tmp/dbg.sgart", RankCheckOptions(dtype=dtype, device="cpu", capture=False, steps=3), device="cpu")
    print(format_checks(checks, 1e-2))
