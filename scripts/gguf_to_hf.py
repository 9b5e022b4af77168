"""Write a bf16 Hugging Face folder of a GGUF model, for peers that cannot read GGUF (vLLM).

The weights are the GGUF's own, dequantized by transformers' GGUF loader, so both servers run the
same model. Usage: python scripts/gguf_to_hf.py MODEL.gguf OUT_DIR (in an environment with
transformers, accelerate and gguf installed).
"""

import json
import sys
from pathlib import Path

import gguf
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig


def main(gguf_path: str, out: str) -> None:
    path = Path(gguf_path).resolve()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16,
                                                 quantization_config=GgufConfig(gguf_file=str(path), dequantize=True))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    config_path = Path(out) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if not config.get("chat_template"):  # some servers read the template from here only
        field = gguf.GGUFReader(str(path)).fields["tokenizer.chat_template"]
        config["chat_template"] = bytes(field.parts[field.data[0]]).decode()
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main(*sys.argv[1:3])
