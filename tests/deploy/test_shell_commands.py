"""The shell reader that finds command lines in the deployment files."""

from __future__ import annotations

from tests.deploy.shell_commands import (
    SimpleCommand,
    markdown_code_spans,
    markdown_shell_scripts,
    simple_commands,
)


def test_lists_and_pipelines_split_into_simple_commands() -> None:
    script = "mkdir -p logs; a --x 1 && b | c || d & e"
    assert [c.argv for c in simple_commands(script)] == [
        ("mkdir", "-p", "logs"), ("a", "--x", "1"), ("b",), ("c",), ("d",), ("e",),
    ]


def test_redirections_and_their_targets_are_not_arguments() -> None:
    script = "nohup kvserve serve --port 50051 >> serve.log 2>&1 < /dev/null &"
    assert simple_commands(script) == [SimpleCommand({}, ("kvserve", "serve", "--port", "50051"))]


def test_leading_assignments_are_the_commands_environment() -> None:
    (command,) = simple_commands("ulimit -n 1; RAY_AUTH_MODE=token ray start --head")[1:]
    assert command == SimpleCommand({"RAY_AUTH_MODE": "token"}, ("ray", "start", "--head"))


def test_control_flow_keywords_come_before_the_command_name() -> None:
    script = "while true; do kvserve serve; [ $? -eq 1 ] || break; done"
    assert ("kvserve", "serve") in [c.argv for c in simple_commands(script)]


def test_scripts_given_to_bash_c_and_ray_exec_are_read_too() -> None:
    script = "ray exec cluster.yaml 'kvserve generate \"Hi there\"'; bash -c 'kvserve serve --tp 2'"
    argvs = [c.argv for c in simple_commands(script)]
    assert ("kvserve", "generate", "Hi there") in argvs
    assert ("kvserve", "serve", "--tp", "2") in argvs


def test_quoted_text_of_other_commands_is_not_read_as_a_script() -> None:
    argvs = [c.argv for c in simple_commands('echo "kvserve serve failed"')]
    assert argvs == [("echo", "kvserve serve failed")]


def test_continued_lines_join_and_comments_are_dropped() -> None:
    script = "kvserve generate \\\n  --max-tokens 4 Hello   # a comment\n# kvserve nothing"
    assert [c.argv for c in simple_commands(script)] == [("kvserve", "generate", "--max-tokens", "4", "Hello")]


def test_markdown_shell_blocks_and_code_spans_are_told_apart() -> None:
    text = "Run `kvserve serve --tp 2` now.\n\n```bash\nkvserve serve\n```\n\n```text\nkvserve diagram\n```\n"
    assert markdown_shell_scripts(text) == ["kvserve serve"]
    assert markdown_code_spans(text) == ["kvserve serve --tp 2"]
