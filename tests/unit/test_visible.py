"""Text from a run reaches a person with every control character and escape sequence shown, never interpreted."""

from composer.rollout.sandbox.results import CommandResult, SandboxResult, visible


def test_controls_and_escape_sequences_become_visible_escapes():
    text = "ok\tline\n\x1b]8;;http://x\x07link\x1b[0m\r\x08\x00\x7f\x85\u202egnp.exe\u200b é"
    shown = visible(text)
    assert shown == "ok\tline\n\\x1b]8;;http://x\\x07link\\x1b[0m\\x0d\\x08\\x00\\x7f\\x85\\u202egnp.exe\\u200b é"
    assert visible(shown) == shown


def test_results_carry_only_visible_text():
    result = SandboxResult(0.0, 0, 1, "ok", "d\x1b[1m", "out\x07", "err\r", 0.1, flag_details=("change_dropped: \x1b[2Jx.py",))
    assert (result.detail, result.stdout_tail, result.stderr_tail) == ("d\\x1b[1m", "out\\x07", "err\\x0d")
    assert result.flag_details == ("change_dropped: \\x1b[2Jx.py",)
    assert CommandResult(0, "ok", "\x1b[31mred", 0.1).output == "\\x1b[31mred"
