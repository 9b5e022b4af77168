"""The agent session `stratum bench agent` sends: a system prompt of instructions and tool schemas shaped
like a coding CLI's (Claude Code's tool names and parameters: tests/data/agents holds what it sends),
the user's task, then turns that each add the assistant's tool call and the tool's result. Seeded:
every server gets the same bytes, in the OpenAI chat format with `tools`."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from stratum.bench.speculative import make_code_file
from stratum.bench.workloads import make_text

# (name, what it does, its parameters: name -> (JSON type, description), the required ones): the tools a
# coding CLI offers, with the parameters Claude Code's schemas have
TOOLS: tuple[tuple[str, str, dict[str, tuple[str, str]], tuple[str, ...]], ...] = (
    ("Bash", "Executes a bash command in a persistent shell session with an optional timeout.",
     {"command": ("string", "The command to execute"), "timeout": ("number", "Optional timeout in milliseconds"),
      "description": ("string", "Clear, concise description of what this command does"),
      "run_in_background": ("boolean", "Run this command in the background")}, ("command",)),
    ("Read", "Reads a file from the local filesystem.",
     {"file_path": ("string", "The absolute path to the file to read"),
      "offset": ("number", "The line number to start reading from"),
      "limit": ("number", "The number of lines to read")}, ("file_path",)),
    ("Edit", "Performs exact string replacements in files.",
     {"file_path": ("string", "The absolute path to the file to modify"),
      "old_string": ("string", "The text to replace"), "new_string": ("string", "The text to replace it with"),
      "replace_all": ("boolean", "Replace all occurrences of old_string")},
     ("file_path", "old_string", "new_string")),
    ("Write", "Writes a file to the local filesystem.",
     {"file_path": ("string", "The absolute path to the file to write"),
      "content": ("string", "The content to write to the file")}, ("file_path", "content")),
    ("Glob", "Fast file pattern matching tool that works with any codebase size.",
     {"pattern": ("string", "The glob pattern to match files against"),
      "path": ("string", "The directory to search in")}, ("pattern",)),
    ("Grep", "A powerful search tool built on ripgrep.",
     {"pattern": ("string", "The regular expression pattern to search for in file contents"),
      "path": ("string", "File or directory to search in"), "glob": ("string", "Glob pattern to filter files"),
      "output_mode": ("string", "content, files_with_matches or count"),
      "-n": ("boolean", "Show line numbers in output")}, ("pattern",)),
    ("Agent", "Launch a new agent to handle complex, multi-step tasks autonomously.",
     {"description": ("string", "A short (3-5 word) description of the task"),
      "prompt": ("string", "The task for the agent to perform"),
      "subagent_type": ("string", "The type of specialized agent to use for this task")},
     ("description", "prompt")),
    ("TodoWrite", "Create and manage a structured task list for your current coding session.",
     {"todos": ("array", "The updated todo list")}, ("todos",)),
    ("WebFetch", "Fetches content from a specified URL and processes it using an AI model.",
     {"url": ("string", "The URL to fetch content from"), "prompt": ("string", "The prompt to run on the content")},
     ("url", "prompt")),
    ("NotebookEdit", "Completely replaces the contents of a specific cell in a Jupyter notebook.",
     {"notebook_path": ("string", "The absolute path to the notebook"),
      "cell_id": ("string", "The ID of the cell to edit"), "new_source": ("string", "The new source for the cell")},
     ("notebook_path", "new_source")),
    ("Skill", "Execute a skill within the main conversation.",
     {"skill": ("string", "The skill name"), "args": ("string", "Optional arguments for the skill")}, ("skill",)),
    ("ExitPlanMode", "Prompts the user to exit plan mode and start coding.",
     {"plan": ("string", "The plan you came up with")}, ("plan",)),
)
TASK = "The tests in tests/test_orders.py fail since the last refactor. Find out why and fix it."
# the calls the turns make, in order (then again): each result is generated to --tool-result-tokens
CALLS = (("Bash", {"command": "python -m pytest tests/test_orders.py -x -q", "description": "Run the failing tests"}),
         ("Read", {"file_path": "/home/user/project/src/orders.py"}),
         ("Grep", {"pattern": "def load_", "path": "/home/user/project/src", "output_mode": "content"}),
         ("Read", {"file_path": "/home/user/project/tests/test_orders.py"}),
         ("Edit", {"file_path": "/home/user/project/src/orders.py", "old_string": "load_order(",
                   "new_string": "read_order("}),
         ("Bash", {"command": "python -m pytest tests/ -q", "description": "Run the whole suite"}))


@dataclass(frozen=True, slots=True)
class Session:
    system: str
    tools: list[dict]  # [] where the schemas are written into the system prompt
    turns: list[list[dict]]  # each turn's whole message list, as the client sends it

    @property
    def num_system_chars(self) -> int:
        return len(self.system) + len(json.dumps(self.tools))


def tool_schemas(rng: random.Random, num_tokens: int, num_tools: int = len(TOOLS)) -> list[dict]:
    """The first num_tools tools as OpenAI function tools, their descriptions long as a coding CLI's
    (usage notes, examples) to about num_tokens tokens in all."""
    per_tool = max(16, num_tokens // num_tools)
    out = []
    for name, what, params, required in TOOLS[:num_tools]:
        properties = {p: {"type": t, "description": d} | ({"items": {"type": "object"}} if t == "array" else {})
                      for p, (t, d) in params.items()}
        out.append({"type": "function", "function": {
            "name": name, "description": f"{what}\n\nUsage notes:\n{make_text(rng, per_tool - 40)}",
            "parameters": {"type": "object", "properties": properties, "required": list(required),
                           "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}}})
    return out


def tool_result(rng: random.Random, name: str, num_tokens: int) -> str:
    """What the tool answered: a file's numbered lines for Read, a command's output otherwise."""
    if name == "Read":
        source = ""
        while len(source) < num_tokens * 3:
            source += make_code_file(rng, 3)[0] + "\n\n"
        lines = source[: num_tokens * 3].splitlines()
        return "\n".join(f"{i + 1:>6}\t{line}" for i, line in enumerate(lines))
    return make_text(rng, num_tokens)


def make_session(seed: int, system_tokens: int, num_turns: int, tool_result_tokens: int,
                 tools_in_system: bool = True, num_tools: int = len(TOOLS)) -> Session:
    """The system prompt (a quarter instructions, the rest tool schemas) and num_turns turns: the first
    is the task alone, each later one adds the previous turn's tool call and its result.

    tools_in_system: the schemas written into the system prompt as JSON lines, as a chat template
    without tools renders them, so every server reads the same text (llama-server drops `tools` the
    template cannot render); False: sent as the request's `tools`, as the CLIs do."""
    rng = random.Random(seed)
    system = ("You are an interactive CLI tool that helps users with software engineering tasks. Use the "
              "instructions below and the tools available to you to assist the user.\n\n"
              + make_text(rng, system_tokens // 4))
    tools = tool_schemas(rng, system_tokens - system_tokens // 4, num_tools)
    if tools_in_system:
        system += ("\n\n# Tools\n\nYou may call one or more functions. Their signatures, one JSON object a line:\n"
                   + "\n".join(json.dumps(t["function"]) for t in tools)
                   + '\n\nFor each call, reply with {"name": ..., "arguments": {...}} in <tool_call></tool_call> tags.')
        tools = []
    messages = [{"role": "system", "content": system}, {"role": "user", "content": TASK}]
    turns = [list(messages)]
    for k in range(1, num_turns):
        name, arguments = CALLS[(k - 1) % len(CALLS)]
        call_id = f"call_{k}"
        result = tool_result(rng, name, tool_result_tokens)
        if tools_in_system:  # the call and its result as text, as such a template renders them
            call = json.dumps({"name": name, "arguments": arguments})
            messages = messages + [{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                                   {"role": "user", "content": f"<tool_response>\n{result}\n</tool_response>"}]
        else:
            function = {"name": name, "arguments": json.dumps(arguments)}
            messages = messages + [
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": call_id, "type": "function", "function": function}]},
                {"role": "tool", "tool_call_id": call_id, "content": result}]
        turns.append(messages)
    return Session(system, tools, turns)
