"""llama.cpp's built-in chat templates by name (``--chat-template chatml``, ``llama3``, ``command-r``, ...), written as
Jinja so that they render, and are shown, like any template. Each gives what llama.cpp's ``llm_chat_apply_template``
(``src/llama-chat.cpp``) writes for the same conversation: the message contents as given (trimmed where llama.cpp
trims them), a generation prompt only where llama.cpp writes one."""

from __future__ import annotations


def _each(turn: str, prompt: str = "", before: str = "") -> str:
    """A template writing `before`, then `turn` for every message (``m`` is the message, ``loop`` the loop), then
    `prompt` when a generation prompt is asked for."""
    tail = f"{{% if add_generation_prompt %}}{prompt}{{% endif %}}" if prompt else ""
    return f"{before}{{% for m in messages %}}{turn}{{% endfor %}}{tail}"


def _roles(cases: dict[str, str], other: str = "") -> str:
    """A turn chosen by the message's role (`other`: any role not listed)."""
    out = ""
    for i, (role, text) in enumerate(cases.items()):
        out += f"{{% {'if' if i == 0 else 'elif'} m.role == '{role}' %}}{text}"
    if other:
        out += f"{{% else %}}{other}"
    return out + "{% endif %}"


_C = "{{ m.content }}"  # the content as given
_T = "{{ m.content | trim }}"  # the content trimmed


def _mistral_v7(space: str) -> str:
    return _each(_roles({"system": f"[SYSTEM_PROMPT]{space}{_C}[/SYSTEM_PROMPT]", "user": f"[INST]{space}{_C}[/INST]"},
                        other=f"{space}{_C}</s>"))


def _mistral(lead: str, trail: str, trim: bool) -> str:
    content = _T if trim else _C
    opening = f"{{% if not ns.inside %}}{lead}[INST]{trail}{{% set ns.inside = true %}}{{% endif %}}"
    return _each(opening + _roles({"system": _C + "{{ '\\n\\n' }}", "user": f"{_C}{lead}[/INST]"},
                                  other=f"{trail}{content}</s>{{% set ns.inside = false %}}"),
                 before="{% set ns = namespace(inside=false) %}")


def _llama2(system: bool, bos_inside: bool, strip: bool) -> str:
    content = "{{ c }}"
    opening = "{% if not ns.inside %}{% set ns.inside = true %}" + ("<s>[INST] " if bos_inside else "[INST] ") + \
        "{% endif %}"
    sys_turn = "<<SYS>>{{ '\\n' }}{{ c }}{{ '\\n' }}<</SYS>>{{ '\\n\\n' }}" if system else "{{ c ~ '\\n' }}"
    turn = ("{% set c = m.content | trim %}" if strip else "{% set c = m.content %}") + opening + _roles(
        {"system": sys_turn, "user": f"{content} [/INST]"}, other=f"{content}</s>{{% set ns.inside = false %}}")
    return _each(turn, before="{% set ns = namespace(inside=true) %}[INST] ")


def _gemma() -> str:
    turn = _roles({"system": "{% set ns.sys = ns.sys ~ (m.content | trim) %}"},
                  other="{% set role = 'model' if m.role == 'assistant' else m.role %}<start_of_turn>{{ role }}"
                  "{{ '\\n' }}{% if ns.sys and role != 'model' %}{{ ns.sys ~ '\\n\\n' }}{% set ns.sys = '' %}"
                  "{% endif %}" + _T + "<end_of_turn>{{ '\\n' }}")
    return _each(turn, "<start_of_turn>model{{ '\\n' }}", before="{% set ns = namespace(sys='') %}")


def _orion() -> str:
    turn = _roles({"system": "{% set ns.sys = ns.sys ~ m.content %}",
                   "user": "Human: {% if ns.sys %}{{ ns.sys ~ '\\n\\n' }}{% set ns.sys = '' %}{% endif %}"
                   + _C + "{{ '\\n\\n' }}Assistant: </s>"}, other=_C + "</s>")
    return _each(turn, before="{% set ns = namespace(sys='') %}")


_NL = "{{ '\\n' }}"
_NL2 = "{{ '\\n\\n' }}"

NAMED_TEMPLATES: dict[str, str] = {
    "chatml": _each(f"<|im_start|>{{{{ m.role }}}}{_NL}{_C}<|im_end|>{_NL}", f"<|im_start|>assistant{_NL}"),
    "llama2": _llama2(system=False, bos_inside=False, strip=False),
    "llama2-sys": _llama2(system=True, bos_inside=False, strip=False),
    "llama2-sys-bos": _llama2(system=True, bos_inside=True, strip=False),
    "llama2-sys-strip": _llama2(system=True, bos_inside=False, strip=True),
    "mistral-v1": _mistral(" ", " ", trim=False),
    "mistral-v3": _mistral("", " ", trim=True),
    "mistral-v3-tekken": _mistral("", "", trim=False),
    "mistral-v7": _mistral_v7(" "),
    "mistral-v7-tekken": _mistral_v7(""),
    "phi3": _each(f"<|{{{{ m.role }}}}|>{_NL}{_C}<|end|>{_NL}", f"<|assistant|>{_NL}"),
    "phi4": _each(f"<|im_start|>{{{{ m.role }}}}<|im_sep|>{_C}<|im_end|>", "<|im_start|>assistant<|im_sep|>"),
    "falcon3": _each(f"<|{{{{ m.role }}}}|>{_NL}{_C}{_NL}", f"<|assistant|>{_NL}"),
    "zephyr": _each(f"<|{{{{ m.role }}}}|>{_NL}{_C}<|endoftext|>{_NL}", f"<|assistant|>{_NL}"),
    "monarch": _each(f"{{% if not loop.first %}}<s>{{% endif %}}{{{{ m.role }}}}{_NL}{_C}</s>{_NL}",
                     f"<s>assistant{_NL}"),
    "gemma": _gemma(),
    "orion": _orion(),
    "openchat": _each(_roles({"system": f"{_C}<|end_of_turn|>"},
                             other=f"GPT4 Correct {{{{ m.role[:1] | upper }}}}{{{{ m.role[1:] }}}}: {_C}<|end_of_turn|>"),
                      "GPT4 Correct Assistant:"),
    "vicuna": _each(_roles({"system": f"{_C}{_NL2}", "user": f"USER: {_C}{_NL}",
                            "assistant": f"ASSISTANT: {_C}</s>{_NL}"}), "ASSISTANT:"),
    "vicuna-orca": _each(_roles({"system": f"SYSTEM: {_C}{_NL}", "user": f"USER: {_C}{_NL}",
                                 "assistant": f"ASSISTANT: {_C}</s>{_NL}"}), "ASSISTANT:"),
    "deepseek": _each(_roles({"system": _C, "user": f"### Instruction:{_NL}{_C}{_NL}",
                              "assistant": f"### Response:{_NL}{_C}{_NL}<|EOT|>{_NL}"}), f"### Response:{_NL}"),
    "deepseek2": _each(_roles({"system": f"{_C}{_NL2}", "user": f"User: {_C}{_NL2}",
                               "assistant": f"Assistant: {_C}<｜end▁of▁sentence｜>"}), "Assistant:"),
    "deepseek3": _each(_roles({"system": f"{_C}{_NL2}", "user": f"<｜User｜>{_C}",
                               "assistant": f"<｜Assistant｜>{_C}<｜end▁of▁sentence｜>"}), "<｜Assistant｜>"),
    "deepseek-ocr": _each(_C),
    "command-r": _each(_roles({"system": f"<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>{_T}<|END_OF_TURN_TOKEN|>",
                               "user": f"<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{_T}<|END_OF_TURN_TOKEN|>",
                               "assistant": f"<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{_T}<|END_OF_TURN_TOKEN|>"}),
                       "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"),
    "llama3": _each(f"<|start_header_id|>{{{{ m.role }}}}<|end_header_id|>{_NL2}{_T}<|eot_id|>",
                    f"<|start_header_id|>assistant<|end_header_id|>{_NL2}"),
    "chatglm3": _each(f"<|{{{{ m.role }}}}|>{_NL} {_C}", "<|assistant|>", before="[gMASK]sop"),
    "chatglm4": _each(f"<|{{{{ m.role }}}}|>{_NL}{_C}", f"<|assistant|>{_NL}", before="[gMASK]<sop>"),
    "glmedge": _each(f"<|{{{{ m.role }}}}|>{_NL}{_C}", "<|assistant|>"),
    "minicpm": _each(_roles({"user": f"<用户>{_T}<AI>"}, other=_T)),
    "exaone3": _each(_roles({"system": f"[|system|]{_T}[|endofturn|]{_NL}", "user": f"[|user|]{_T}{_NL}",
                             "assistant": f"[|assistant|]{_T}[|endofturn|]{_NL}"}), "[|assistant|]"),
    "exaone4": _each(_roles({"system": f"[|system|]{_T}[|endofturn|]{_NL}", "user": f"[|user|]{_T}{_NL}",
                             "assistant": f"[|assistant|]{_T}[|endofturn|]{_NL}",
                             "tool": f"[|tool|]{_T}[|endofturn|]{_NL}"}), "[|assistant|]"),
    "exaone-moe": _each(_roles({role: f"<|{role}|>{_NL}{_T}<|endofturn|>{_NL}"
                                for role in ("system", "user", "assistant", "tool")}), f"<|assistant|>{_NL}"),
    "rwkv-world": _each(_roles({"system": f"System: {_T}{_NL2}",
                                "user": f"User: {_T}{_NL2}{{% if loop.last %}}Assistant:{{% endif %}}",
                                "assistant": f"Assistant: {_T}{_NL2}"})),
    "granite": _each("<|start_of_role|>{{ m.role }}<|end_of_role|>{% if m.role == 'assistant_tool_call' %}"
                     f"<|tool_call|>{{% endif %}}{_C}<|end_of_text|>{_NL}", "<|start_of_role|>assistant<|end_of_role|>"),
    "granite-4.0": _each(_roles({"assistant_tool_call": "<|start_of_role|>assistant<|end_of_role|><|tool_call|>"},
                                other="<|start_of_role|>{{ m.role }}<|end_of_role|>") + f"{_C}<|end_of_text|>{_NL}",
                         "<|start_of_role|>assistant<|end_of_role|>"),
    "granite-4.1": _each(_roles({"assistant_tool_call": "<|start_of_role|>assistant<|end_of_role|><|tool_call|>"},
                                other="<|start_of_role|>{{ m.role }}<|end_of_role|>") + f"{_C}<|end_of_text|>{_NL}",
                         "<|start_of_role|>assistant<|end_of_role|>"),
    "gigachat": _each("{% if loop.first and m.role == 'system' %}" + f"{_C}<|message_sep|>{{% else %}}" + _roles(
        {"user": f"user<|role_sep|>{_C}<|message_sep|>available functions<|role_sep|>[]<|message_sep|>",
         "assistant": f"assistant<|role_sep|>{_C}<|message_sep|>"}) + "{% endif %}", "assistant<|role_sep|>",
        before="<s>"),
    "megrez": _each(f"<|role_start|>{{{{ m.role }}}}<|role_end|>{_C}<|turn_end|>", "<|role_start|>assistant<|role_end|>"),
    "yandex": _each(_roles({"user": f" Пользователь: {_C}{_NL2}", "assistant": f" Ассистент: {_C}{_NL2}"}),
                    " Ассистент:[SEP]"),
    "bailing": _each("<role>{{ 'HUMAN' if m.role == 'user' else m.role | upper }}</role>" + _C,
                     "<role>ASSISTANT</role>"),
    "bailing-think": _each("<role>{{ 'HUMAN' if m.role == 'user' else m.role | upper }}</role>" + _C,
                           "<role>ASSISTANT</role><think>"),
    "bailing2": _each("<role>{{ 'HUMAN' if m.role == 'user' else m.role | upper }}</role>" + _C + "<|role_end|>",
                      "<role>ASSISTANT</role>",
                      before="{% if not messages or messages[0].role != 'system' %}"
                      "<role>SYSTEM</role>detailed thinking off<|role_end|>{% endif %}"),
    "llama4": _each(f"<|header_start|>{{{{ m.role }}}}<|header_end|>{_NL2}{_T}<|eot|>",
                    f"<|header_start|>assistant<|header_end|>{_NL2}"),
    "smolvlm": _each(_roles({"system": f"{_C}{_NL2}", "user": f"User: {_C}<end_of_utterance>{_NL}"},
                            other=f"Assistant: {_C}<end_of_utterance>{_NL}"), "Assistant:", before="<|im_start|>"),
    "hunyuan-moe": _each(_roles({"system": f"<|startoftext|>{_C}<|extra_4|>", "assistant": f"{_C}<|eos|>"},
                                other=f"<|startoftext|>{_C}<|extra_0|>")),
    "gpt-oss": _each("<|start|>{{ m.role }}<|message|>" + _C + "{{ '<|return|>' if m.role == 'assistant' else "
                     "'<|end|>' }}", "<|start|>assistant"),
    "hunyuan-dense": _each("{% if loop.first and m.role == 'system' %}" + _C + "<｜hy_place▁holder▁no▁3｜>{% endif %}"
                           + _roles({"assistant": f"<｜hy_Assistant｜>{_C}<｜hy_place▁holder▁no▁2｜>",
                                     "user": f"<｜hy_User｜>{_C}<｜hy_Assistant｜>"})),
    "hunyuan-vl": _each("{% if loop.first and m.role == 'system' %}" + _C + "<｜hy_place▁holder▁no▁3｜>{% else %}"
                        + _roles({"user": f"{_C}<｜hy_User｜>", "assistant": f"{_C}<｜hy_Assistant｜>"})
                        + "{% endif %}", before="<｜hy_begin▁of▁sentence｜>"),
    "kimi-k2": _each(_roles({"system": "<|im_system|>system<|im_middle|>", "user": "<|im_user|>user<|im_middle|>",
                             "assistant": "<|im_assistant|>assistant<|im_middle|>",
                             "tool": "<|im_system|>tool<|im_middle|>"}) + f"{_C}<|im_end|>",
                     "<|im_assistant|>assistant<|im_middle|>"),
    "seed_oss": _each("<seed:bos>{{ m.role }}" + _NL + "{{ m.content | trim if m.role == 'assistant' else m.content }}"
                      "<seed:eos>", f"<seed:bos>assistant{_NL}"),
    "grok-2": _each(_roles({"system": f"System: {_T}<|separator|>{_NL2}", "user": f"Human: {_T}<|separator|>{_NL2}",
                            "assistant": f"Assistant: {_C}<|separator|>{_NL2}"}), "Assistant:"),
    "pangu-embedded": _each("{% if loop.first and m.role != 'system' %}[unused9]系统：[unused10]{% endif %}" + _roles(
        {"system": f"[unused9]系统：{_C}[unused10]", "user": f"[unused9]用户：{_C}[unused10]",
         "assistant": f"[unused9]助手：{_C}[unused10]", "tool": f"[unused9]工具：{_C}[unused10]",
         "function": f"[unused9]方法：{_C}[unused10]"}), "[unused9]助手："),
    "solar-open": _each(f"<|begin|>{{{{ m.role }}}}<|content|>{_C}<|end|>", "<|begin|>assistant"),
}
"""Every name llama.cpp's ``--chat-template`` takes for a built-in template, and its Jinja text."""


def named_template(name: str) -> str | None:
    """The Jinja text of llama.cpp's built-in template `name`, or None when it names none."""
    return NAMED_TEMPLATES.get(name)
