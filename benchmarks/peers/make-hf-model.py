"""Write a GGUF model (the bundled SmolLM2-135M-Instruct) out as a Hugging Face folder, bf16 safetensors and
tokenizer, for peers that cannot read the GGUF offline (vLLM) and for `--quantization int8` benchmarks. Any venv
with transformers, torch and gguf runs it (kvserve's own, or the vLLM venv):

  .venv/bin/python benchmarks/peers/make-hf-model.py PATH/TO/MODEL.gguf OUT_DIR

`make hf-models` writes $PEERS/smollm2-135m-instruct (from the bundled GGUF) and $PEERS/qwen2.5-coder-1.5b-instruct
(from the Q4_K_M file `make models` fetches: its dequantized weights, in bf16).
"""
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    gguf, out = Path(sys.argv[1]), sys.argv[2]
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config   # the copy holds plain bf16 weights
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict({k: v.detach().to(torch.bfloat16) for k, v in quantized.state_dict().items()})
    model.tie_weights()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print("wrote", out)


if __name__ == "__main__":
    main()
