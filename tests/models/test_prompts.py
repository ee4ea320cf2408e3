from pathlib import Path

import rlscale
from rlscale.models import PromptRenderer, load_tokenizer

ASSET = Path(rlscale.__file__).parent / "assets" / "tiny-arith"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"


class CountingRenderer(PromptRenderer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def render(self, text):
        self.calls += 1
        return super().render(text)


def test_render_all_renders_each_distinct_text_once_and_matches_render():
    for template in (None, TEMPLATE):
        tok = load_tokenizer(str(ASSET))
        tok.chat_template = template
        renderer = CountingRenderer(tok)
        assert renderer.use_chat == (template is not None)
        texts = [text for text in ("12+7=", "3*4=", "100-1=") for _ in range(4)]
        rendered = renderer.render_all(texts)
        assert renderer.calls == 3
        assert rendered == [PromptRenderer(tok).render(text) for text in texts]
        assert rendered[0] != rendered[4]
        rendered[0].append(-1)  # rows of one text are separate lists (callers may cut them)
        assert rendered[1] != rendered[0]
