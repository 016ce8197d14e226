"""Chat templates render exactly as transformers renders them, from either file a folder may hold."""
import json

import pytest

from kvlib.model.errors import CheckpointError
from kvlib.tokenizer import Tokenizer

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[SYS] {{ m['content'] | trim }}\n"
            "{% else %}[{{ m['role'] | upper }}] {{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")
MESSAGES = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "w3 w4"},
            {"role": "assistant", "content": "w5"}, {"role": "user", "content": "w6"}]


@pytest.fixture
def folder(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers
    words = {f"w{i}": i for i in range(10)} | {"<s>": 10, "</s>": 11}
    tokenizer = HFTokenizer(models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True}}))
    return tmp_path


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_like_transformers(where, add_generation_prompt, folder):
    import transformers
    if where == "chat_template.jinja":
        (folder / where).write_text(TEMPLATE)
    else:
        config = json.loads((folder / where).read_text())
        (folder / where).write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    ours, theirs = Tokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(folder)
    expected = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt) == expected
    assert ours.encode_chat(MESSAGES, add_generation_prompt) == theirs.apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=add_generation_prompt)["input_ids"]


def test_folder_without_template_says_so(folder):
    with pytest.raises(ValueError, match="has no chat template"):
        Tokenizer.from_folder(folder).apply_chat_template(MESSAGES)


def test_malformed_message_is_named(folder):
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    with pytest.raises(ValueError, match="chat message 1 is 'w3'"):
        Tokenizer.from_folder(folder).apply_chat_template([MESSAGES[0], "w3"])


def test_template_that_is_not_jinja_names_its_file(folder):
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}")
    with pytest.raises(CheckpointError, match="chat_template.jinja: the chat template is not valid Jinja"):
        Tokenizer.from_folder(folder)


def test_template_raising_an_exception_reads_its_message(folder):
    (folder / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    from jinja2 import TemplateError
    with pytest.raises(TemplateError, match="roles must alternate"):
        Tokenizer.from_folder(folder).apply_chat_template(MESSAGES)

