"""Build the embedded default model's tokenizer (run once; the output is committed).

    python scripts/build_tokenizer.py

Trains a byte-level BPE tokenizer on a corpus this script generates deterministically (English
words and sentences from a fixed seed), so the result can be rebuilt anywhere with no download.
Writes tokenizer.json, tokenizer_config.json (with the chat template) and
special_tokens_map.json into veloxquant_mlx/engine/model/assets/.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 2048
OUT = Path(__file__).resolve().parent.parent / "veloxquant_mlx" / "engine" / "model" / "assets"
SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# Roles in tags, a system prompt like any message, and tools in the Hermes/Qwen format (JSON in
# <tool_call> tags, which mlx_lm's json_tools parser reads and forced calls constrain).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\nTools (call one as <tool_call>"
    '{"name": ..., "arguments": {...}}</tool_call>):\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|end|>\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message.tool_calls %}{% for tool_call in message.tool_calls %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    '<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "</tool_call>{% endfor %}{% else %}{{ message['content'] }}{% endif %}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORD_TEXT = (
    "the a an of to in and is was for on with as by at from that this it be are or not have "
    "has model memory block pool cache key value token request server stream batch decode "
    "prefill time first second hello world what who why how when where which answer question "
    "please tell me about story write code python function return list dict number one two "
    "three four five six seven eight nine ten hundred thousand apple silicon mac linux cpu "
    "gpu metal fast slow large small tiny big good bad new old day night sun moon sky sea "
    "river mountain city people man woman child friend teacher student book page word line "
    "text name place thing run walk read speak think know see make take give find use work "
    "call try ask need feel become leave put mean keep let begin seem help show hear play "
    "move live believe bring "
)
WORDS = _WORD_TEXT.split()


def corpus(n_sentences: int = 20000, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 14))]
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ","])
        if rng.random() < 0.2:
            sentence += f" {rng.randint(0, 9999)}"
        lines.append(sentence)
    lines += [" ".join(WORDS), "0123456789 +-*/=()[]{}<>:;'\"`~!@#$%^&_|\\"]
    return lines


def main() -> None:
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    OUT.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(OUT / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "add_bos_token": False,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (OUT / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"}
    (OUT / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    print(f"wrote {OUT} (vocab {tokenizer.get_vocab_size()})")


if __name__ == "__main__":
    main()
