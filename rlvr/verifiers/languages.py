"""The compiled (and other non-Python) languages the sandbox judges: one table entry each.

An entry says how to build a program from one source file and how to run it; ``{src}`` in a command is the
source file's name, ``{main}`` the class or file the run starts (Java: the class holding ``main``). Every command
runs inside the sandbox (``sandbox.py``) as the candidate's user, in its private /work, with PATH=/usr/bin:/bin.
Adding a language is one entry here, its MultiPL-E test style in ``assertion_programs.py`` (and, when its assertion
programs build in more than one step, ``compiled._steps``) and its tests.
"""

from __future__ import annotations

import glob
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

JVM_FLAGS = ("-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-XX:ReservedCodeCacheSize=32m",
             "-XX:CompressedClassSpaceSize=64m", "-XX:MaxMetaspaceSize=128m", "-XX:-UsePerfData")


@dataclass(frozen=True)
class Language:
    name: str
    source: str  # the program's file name ({main} is filled in for Java)
    build: tuple[tuple[str, ...], ...]  # commands, in order; none: nothing to build
    run: tuple[str, ...]
    artifacts: tuple[str, ...]  # what a build leaves that a run needs (kept in the compile cache); globs
    stop: tuple[str, ...]  # stop sequences for a completion that continues a MultiPL-E prompt
    tools: tuple[str, ...]  # executables that must be on PATH
    package: str  # what to install when a tool is missing
    aliases: tuple[str, ...] = ()  # the names datasets use (MultiPL-E: cpp, rs, js) and fence tags
    run_cpu_extra_s: float = 0.0  # CPU seconds a run costs before the program starts (a JVM's own start)
    processes: int = 0  # threads the runtime starts itself (they count against the process cap)
    expose: tuple[str, ...] = ()  # directories (globs) outside /usr and /lib* the tools read: configuration
    compiler: tuple[str, ...] = ()  # C, C++, Rust: the command an assertion program's two units are built by
    link: tuple[str, ...] = ()  # ... and what the link adds


LANGUAGES = {lang.name: lang for lang in (
    Language("c", "prog.c", (("gcc", "-std=gnu17", "-O2", "-pipe", "-o", "prog", "{src}", "-lm"),), ("./prog",),
             ("prog",), ("\n}",), ("gcc", "ld", "objcopy"), "gcc and binutils (apt: build-essential)", ("c", "h"),
             compiler=("gcc", "-std=gnu17", "-O2", "-pipe"), link=("-lm",)),
    Language("cpp", "prog.cpp", (("g++", "-std=gnu++17", "-O2", "-pipe", "-o", "prog", "{src}"),), ("./prog",),
             ("prog",), ("\n}",), ("g++", "ld", "objcopy"), "g++ and binutils (apt: build-essential)",
             ("c++", "cc", "cxx", "cpp"),
             compiler=("g++", "-std=gnu++17", "-O2", "-pipe")),
    Language("rust", "prog.rs", (("rustc", "--edition", "2021", "-C", "opt-level=1", "-C", "debuginfo=0",
                                  "-C", "strip=symbols", "-o", "prog", "{src}"),), ("./prog",), ("prog",),
             ("\n}",), ("rustc", "cc"), "rustc (https://rustup.rs, or apt: rustc)", ("rs", "rust"),
             compiler=("rustc", "--edition", "2021", "-C", "opt-level=1", "-C", "debuginfo=0", "-C", "strip=symbols")),
    Language("java", "{main}.java", (("javac", *(f"-J{f}" for f in JVM_FLAGS), "-encoding", "UTF-8", "-nowarn",
                                      "-d", ".", "{src}"),), ("java", *JVM_FLAGS, "-ea", "-cp", ".", "{main}"),
             ("*.class",), ("\n    }\n",), ("javac", "java"), "a JDK (apt: openjdk-17-jdk-headless)", ("java",),
             run_cpu_extra_s=1.0, processes=32, expose=("/etc/java-*",)),
    Language("javascript", "prog.js", (("node", "--check", "{src}"),), ("node", "--max-old-space-size=256",
                                                                        "--stack-size=8192", "{src}"),
             ("prog.js",), ("\nfunction ", "\n/*", "\n//", "\nconsole.log"), ("node",), "Node.js (apt: nodejs)",
             ("js", "javascript", "node"), run_cpu_extra_s=0.2, processes=16),
)}


def language(name: str) -> Language:
    """The entry for a language name or alias (case-insensitive); ValueError listing what exists."""
    key = str(name).strip().lower()
    for lang in LANGUAGES.values():
        if key == lang.name or key in lang.aliases:
            return lang
    raise ValueError(f"unknown language {name!r}; rlvr judges {', '.join(LANGUAGES)} (and Python with code_tests)")


def missing_tools(lang: Language) -> str | None:
    """One line naming what to install when ``lang``'s tools are not on PATH, else None."""
    absent = [tool for tool in lang.tools if shutil.which(tool) is None]
    if not absent:
        return None
    return f"{lang.name} needs {', '.join(absent)} on PATH: install {lang.package}"


def java_main_class(source: str) -> str:
    """The class whose ``main`` starts a Java program (MultiPL-E: Problem; judges: Main), else Main."""
    for match in re.finditer(r"\bclass\s+([A-Za-z_$][\w$]*)", source):
        rest = source[match.end():]
        following = re.search(r"\bclass\s+[A-Za-z_$]", rest)
        body = rest[:following.start()] if following else rest
        if re.search(r"\bstatic\s+void\s+main\s*\(", body):
            return match.group(1)
    return "Main"


def exposed_paths(langs) -> list[str]:
    """Directories outside /usr and /lib* that the sandbox must show read-only: /etc/alternatives (Debian's
    cc, javac, java are links through it), a language's configuration, rustup's toolchain."""
    paths = ["/etc/alternatives"]
    for lang in langs:
        paths += [p for pattern in lang.expose for p in sorted(glob.glob(pattern)) if p not in paths]
        for tool in lang.tools:
            where = shutil.which(tool)
            if where and not Path(where).resolve().is_relative_to("/usr"):
                root = _toolchain_root(tool)
                if root and root not in paths:
                    paths.append(root)
    return paths


@cache
def _toolchain_root(tool: str) -> str | None:
    if tool == "rustc":  # rustup's proxy needs RUSTUP_HOME; the toolchain's own rustc does not
        out = subprocess.run(["rustc", "--print", "sysroot"], capture_output=True, text=True, check=False)
        return out.stdout.strip() or None
    return str(Path(shutil.which(tool)).resolve().parent.parent)


def tool_path(tool: str) -> str:
    """The path a build runs ``tool`` by inside the sandbox (rustup's proxies resolved to the toolchain's binary)."""
    if tool == "rustc" and (root := _toolchain_root("rustc")) and not root.startswith("/usr"):
        return str(Path(root) / "bin" / "rustc")
    return tool


@cache
def toolchain_version(lang_name: str) -> str:
    """The first line of the compiler's ``--version`` (part of the compile cache's key)."""
    lang = LANGUAGES[lang_name]
    tool = lang.build[0][0] if lang.build else lang.run[0]
    try:
        out = subprocess.run([tool_path(tool), "--version"], capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return ((out.stdout or out.stderr).strip().splitlines() or ["unknown"])[0]


@cache
def node_permission_flags() -> tuple[str, ...]:
    """Node's permission model, for JavaScript assertion runs: it refuses the inspector (which reads any closure of
    its own process, the harness's included), child processes, workers and native addons; files stay readable and
    writable. () where this node has none (before 20)."""
    try:
        out = subprocess.run([tool_path("node"), "--help"], capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    for flag in ("--permission", "--experimental-permission"):
        if re.search(rf"(?m)^\s*{flag}\b", out.stdout):
            return flag, "--allow-fs-read=*", "--allow-fs-write=*"
    return ()
