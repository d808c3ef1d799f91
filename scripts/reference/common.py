"""Shared by the reference scripts: the model path and the Hugging Face reference tokenizer for a GGUF.

The reference tokenizer is built with the `tokenizers` library exactly as SmolLM2's original tokenizer.json
configures it (byte-level BPE; pre-tokenizer = Digits(individual) then ByteLevel(no prefix space); control tokens
added as special), which is also what llama.cpp's `smollm` pre-tokenizer does. transformers' own GGUF converter
(used by `AutoTokenizer.from_pretrained(..., gguf_file=...)`) needs torch and drops the digit split; tokenizer.py
reports where that converter would disagree.
"""
import os
import gguf
from tokenizers import Tokenizer, AddedToken, models, pre_tokenizers, decoders
from transformers import PreTrainedTokenizerFast

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path():
    home = os.environ.get("TANDEM_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "tandem")
    return os.path.join(home, "models", MODEL_FILE)


def read_tokenizer_fields(path):
    r = gguf.GGUFReader(path)
    f = lambda k: r.fields[k].contents() if k in r.fields else None
    return dict(
        tokens=[str(t) for t in f("tokenizer.ggml.tokens")],
        types=[int(t) for t in f("tokenizer.ggml.token_type")],
        merges=[str(m) for m in f("tokenizer.ggml.merges")],
        bos=f("tokenizer.ggml.bos_token_id"),
        eos=f("tokenizer.ggml.eos_token_id"),
        template=f("tokenizer.chat_template"),
    )


def reference_tokenizer(path):
    """(tokenizers.Tokenizer, transformers PreTrainedTokenizerFast with the GGUF's chat template)."""
    t = read_tokenizer_fields(path)
    vocab = {tok: i for i, tok in enumerate(t["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in t["merges"]]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tk.decoder = decoders.ByteLevel()
    specials = [AddedToken(tok, special=True, normalized=False) for tok, ty in zip(t["tokens"], t["types"]) if ty == 3]
    tk.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=t["tokens"][t["bos"]],
        eos_token=t["tokens"][t["eos"]],
        chat_template=t["template"],
    )
    return tk, fast
