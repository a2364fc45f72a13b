"""torchrun worker for tests/integration/test_published_checkpoints.py: quantized twins under tp/ep splits.

For each split and checkpoint: full logits of a fixed batch and an export in the checkpoint's own quantized layout.
Usage: published_worker.py OUT_DIR CHECKPOINT...; rank 0 saves OUT_DIR/results.pt, {kind: {split: logits}}.
"""

import json
import os
import sys
from pathlib import Path

import torch

from composer.recipes.schema import ParallelismSection
from composer.trainer.distributed import init_distributed, shutdown_distributed
from composer.trainer.hf_config import model_section_from_hf
from composer.trainer.model import build_model, forward_logits
from composer.trainer.weights import export_hf, load_hf_into

SPLITS = {
    "tp1": ParallelismSection(),
    "tp2_sp": ParallelismSection(tp=2, sequence_parallel=True),
    "ep2": ParallelismSection(ep=2),
}
QUANTIZE = {"fp8": "fp8", "compressed-tensors": "int4"}


def main(out: Path, checkpoints: list[Path]) -> None:
    torch.set_num_threads(1)
    tokens = torch.randint(2, 1000, (2, 48), generator=torch.Generator().manual_seed(3))
    results: dict[str, dict[str, torch.Tensor]] = {}
    for split, p in SPLITS.items():
        init_distributed(p)
        for checkpoint in checkpoints:
            config = json.loads((checkpoint / "config.json").read_text())
            method = (config.get("text_config", config).get("quantization_config") or config["quantization_config"])["quant_method"]
            m = model_section_from_hf(checkpoint)
            model = build_model(m, p).eval()
            load_hf_into(model, m, checkpoint)
            with torch.no_grad():
                results.setdefault(config["model_type"], {})[split] = forward_logits(model, tokens)
            if split != "tp1":
                export_hf(model, m, out / f"export-{config['model_type']}-{split}", quantize=QUANTIZE[method])
    shutdown_distributed()
    if os.environ["RANK"] == "0":
        torch.save(results, out / "results.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), [Path(a) for a in sys.argv[2:]])
