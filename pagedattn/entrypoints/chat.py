"""`pagedattn chat`: an interactive conversation whose turns and forks reuse cached KV blocks."""

from __future__ import annotations

import argparse
import sys

from pagedattn.entrypoints.args import build_llm, sampling_params

HELP = (
    "commands: /fork NAME (branch the conversation here), /switch NAME, /sessions, /stats, "
    "/reset, /quit"
)


class ChatSessions:
    """Named conversations; a fork copies the history, so its prompt hits the same cached blocks."""

    def __init__(self) -> None:
        self.sessions: dict[str, list[dict[str, str]]] = {"main": []}
        self.current = "main"

    @property
    def history(self) -> list[dict[str, str]]:
        return self.sessions[self.current]

    def fork(self, name: str) -> str:
        if not name or name in self.sessions:
            return f"cannot fork to {name!r}: give a new session name"
        self.sessions[name] = list(self.history)
        self.current = name
        return f"forked {name!r} from the current conversation ({len(self.history)} messages)"

    def switch(self, name: str) -> str:
        if name not in self.sessions:
            return f"no session {name!r}; sessions: {', '.join(self.sessions)}"
        self.current = name
        return f"switched to {name!r}"

    def handle_command(self, line: str) -> str | None:
        """Run a /command; return its reply, or None for /quit."""
        cmd, _, arg = line.partition(" ")
        arg = arg.strip()
        if cmd in ("/quit", "/exit"):
            return None
        if cmd == "/fork":
            return self.fork(arg)
        if cmd == "/switch":
            return self.switch(arg)
        if cmd == "/sessions":
            return ", ".join(
                f"{'*' if n == self.current else ''}{n} ({len(h)} msgs)"
                for n, h in self.sessions.items()
            )
        if cmd == "/reset":
            self.sessions[self.current] = []
            return "conversation cleared"
        return HELP


def run_chat(args: argparse.Namespace, stdin=None, stdout=None) -> int:
    """Read user turns from stdin until EOF or /quit; print each reply and its cache reuse."""
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    llm = build_llm(args)
    params = sampling_params(args)
    chats = ChatSessions()
    print(HELP, file=stdout)
    while True:
        print(f"[{chats.current}] you> ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            if line == "/stats":
                s = llm.get_stats()
                reply = (
                    f"blocks free {s.num_free_blocks}/{s.num_blocks}, cached "
                    f"{s.num_cached_blocks}, prefix hits {s.prefix_cache_hits}/"
                    f"{s.prefix_cache_queries} tokens"
                )
            else:
                reply = chats.handle_command(line)
            if reply is None:
                break
            print(reply, file=stdout)
            continue
        chats.history.append({"role": "user", "content": line})
        out = llm.chat(chats.history, params)[0]
        text = out.outputs[0].text.strip()
        chats.history.append({"role": "assistant", "content": text})
        print(f"assistant> {text}", file=stdout)
        print(
            f"  ({len(out.outputs[0].token_ids)} tokens; {out.num_cached_tokens} of "
            f"{len(out.prompt_token_ids)} prompt tokens from cached blocks)",
            file=stdout,
        )
    return 0
