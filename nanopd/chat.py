"""Chat templates: a conversation checked, then rendered into its prompt text by the
tokenizer's chat template, for LLM.chat and LLM.render_chat (llm.py loads this module for
them only; the server's /v1/chat/completions renders through LLM.render_chat).
"""

import jinja2


def render(conversation: list[dict], tokenizer, model: str, chat_template: str | None = None,
           add_generation_prompt: bool = True) -> str:
    """One conversation's prompt text, by tokenizer's chat template (or chat_template), model
    naming the tokenizer's checkpoint. A ValueError names a bad message or template (its
    first word the field at fault), or says that there is no template."""
    (conversation,) = checked_conversations([conversation])
    if (chat_template or getattr(tokenizer, "chat_template", None)) is None:
        raise ValueError(f"the tokenizer of {model} has no chat template: pass chat_template=... (a Jinja "
                         "template, as in the tokenizer_config.json of chat models)")
    try:   # transformers' templates are Jinja: its errors are a bad template, or messages it refuses
        return tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as e:
        at_fault = "chat_template" if chat_template is not None else "messages: the chat template failed"
        raise ValueError(f"{at_fault}: {type(e).__name__}: {e}") from None


def checked_conversations(messages) -> list[list[dict]]:
    """chat's messages as a list of conversations, each message {"role": str, "content": str}
    (content given as OpenAI's text parts, [{"type": "text", "text": ...}], joined by
    newlines, as vLLM does); or a ValueError naming the conversation and the message."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages must be a non-empty list of messages or of conversations, "
                         f"got {messages!r}")
    conversations = [messages] if isinstance(messages[0], dict) else messages
    out = []
    for c, conversation in enumerate(conversations):
        if not isinstance(conversation, list | tuple) or not conversation:
            raise ValueError(f"conversation {c} must be a non-empty list of messages, got {conversation!r}")
        out.append([checked_message(m, f"conversation {c}, message {i}") for i, m in enumerate(conversation)])
    return out


def checked_message(message, where: str) -> dict:
    """One chat message as {"role", "content"} strings (chat's check, checked_conversations)."""
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise ValueError(f"{where} needs a 'role' (a non-empty string such as 'user'), got {role!r}")
    if isinstance(content, list | tuple):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ValueError(f"{where}: content parts must be {{'type': 'text', 'text': str}} "
                             "(the model takes text only)")
        content = "\n".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ValueError(f"{where} needs a 'content' string (or a list of text parts), got {content!r}")
    return {**message, "content": content}
