from pathlib import Path

import rlscale
from rlscale.models import PromptRenderer, load_tokenizer

ASSET = Path(rlscale.__file__).parent / "assets" / "tiny-arith"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"


class CountingRenderer(PromptRenderer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def render_whole(self, text):
        self.calls += 1
        return super().render_whole(text)


def test_render_all_renders_each_distinct_text_once_and_matches_render():
    for template in (None, TEMPLATE):
        tok = load_tokenizer(str(ASSET))
        tok.chat_template = template
        renderer = CountingRenderer(tok)
        assert renderer.use_chat == (template is not None)
        texts = [text for text in ("12+7=", "3*4=", "100-1=") for _ in range(4)]
        rendered, cut = renderer.render_all(texts)
        assert renderer.calls == 3 and cut == [False] * len(texts)
        assert rendered == [PromptRenderer(tok).render(text) for text in texts]
        assert rendered[0] != rendered[4]
        rendered[0].append(-1)  # rows of one text are separate lists (callers may cut them)
        assert rendered[1] != rendered[0]


def test_a_prompt_longer_than_its_room_keeps_its_end_and_is_reported_cut():
    tok = load_tokenizer(str(ASSET))
    whole = PromptRenderer(tok).render("123+456=")
    renderer = PromptRenderer(tok, max_prompt_tokens=len(whole) - 3)
    rendered, cut = renderer.render_all(["123+456=", "1+2="])
    assert rendered[0] == whole[3:] and cut == [True, len(PromptRenderer(tok).render("1+2=")) > len(whole) - 3]
    assert renderer.render("123+456=") == whole[3:]


def bpe_tokenizer(clean_up: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(["12 + 30 = 42 , so the answer is 42 ."] * 50, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   clean_up_tokenization_spaces=clean_up)


def test_decode_responses_equals_batch_decode_and_skips_special_tokens():
    import random

    from rlscale.models.prompts import decode_responses

    random.seed(0)
    for tok in (load_tokenizer("builtin:tiny-arith"), bpe_tokenizer(False), bpe_tokenizer(True)):
        rows = [[random.randrange(len(tok)) for _ in range(random.randint(0, 40))] for _ in range(64)]
        rows.append([tok.eos_token_id, tok.pad_token_id])
        texts = decode_responses(tok, rows)
        assert texts == tok.batch_decode(rows, skip_special_tokens=True)
        assert texts[-1] == "" and len(texts) == len(rows)


def test_decode_responses_follows_a_tokenizer_that_overrides_decoding():
    from rlscale.models.prompts import decode_responses

    base = bpe_tokenizer(False)

    class Shouting(type(base)):
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).upper()

    tok = Shouting(tokenizer_object=base.backend_tokenizer, pad_token="<pad>", eos_token="<eos>",
                   clean_up_tokenization_spaces=False)
    rows = [base.encode("12 + 30 = 42 , so the answer is 42 .")]
    assert decode_responses(tok, rows) == tok.batch_decode(rows, skip_special_tokens=True)
    assert decode_responses(tok, rows) == [decode_responses(base, rows)[0].upper()]
