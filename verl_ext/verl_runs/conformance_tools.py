"""The conformance suite's one tool, loaded by veRL from this file's path
(``actor_rollout_ref.rollout.multi_turn.function_tool_path``): a pure function of its
argument, so veRL's manager and verl_ext's see the same tool response for the same call."""

from verl.tools.function_tool import function_tool


@function_tool("verl_ext_echo")
def verl_ext_echo(text: str) -> str:
    """Answers with the digits of the text it is given.

    Args:
        text: the assistant's turn.
    """
    digits = "".join(ch for ch in text if ch.isdigit())
    return f"digits: {digits[-12:] or 'none'}"
