#!/usr/bin/env python3
"""Write the upgrade script of the release in development:
sql/flow--<previous>--<current>.sql, where <previous> is the newest install
script kept in sql/released/ and <current> the version in Cargo.toml.

The script is the hand-written table and type changes of this step
(sql/upgrade/<previous>--<current>.sql) followed by every function, view and
grant of the current install script (as `cargo pgrx install` generated it
into the extension directory), with CREATE turned into CREATE OR REPLACE.
The bootstrap part (sql/schema.sql: tables, types) is left out: tables keep
their rows and change only through the hand-written part; its functions (the
tables' CHECK and trigger functions) are replaced first, before that part.

Run by tools/setup.sh after each install, so the upgrade script always
carries the current functions; pg_test/test_upgrade.py checks that an updated
database equals a fresh install. Once a release is tagged, its install script
goes to sql/released/ and its upgrade script is never written again.
"""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def version_key(v):
    return tuple(int(x) for x in v.split("."))


def functions_of(sql):
    """The CREATE FUNCTION statements of `sql`, each whole: to its closing
    `$$;` when its body is dollar-quoted, else to the first line ending in `;`."""
    found = []
    for start in re.finditer(r"^CREATE\s+FUNCTION\b", sql, re.M):
        rest = sql[start.start():]
        head_end = rest.find(";\n")
        quote = rest.find("$$")
        if quote != -1 and quote < head_end:
            end = rest.index("$$;", quote + 2) + 3
        else:
            end = head_end + 1
        found.append(rest[:end])
    return found


def main():
    current = re.search(r'^version = "([^"]+)"', (ROOT / "Cargo.toml").read_text(), re.M).group(1)
    released = sorted((p.name[len("flow--"):-len(".sql")] for p in (ROOT / "sql" / "released").glob("flow--*.sql")),
                      key=version_key)
    previous = [v for v in released if version_key(v) < version_key(current)]
    if not previous:
        return
    previous = previous[-1]
    sharedir = subprocess.run([sys.argv[1] if len(sys.argv) > 1 else "/usr/lib/postgresql/15/bin/pg_config",
                               "--sharedir"], check=True, capture_output=True, text=True).stdout.strip()
    install = (Path(sharedir) / "extension" / f"flow--{current}.sql").read_text()
    blocks = re.findall(r"/\* <begin connected objects> \*/\n(.*?)/\* </end connected objects> \*/", install, re.S)
    code = [b for b in blocks if "\n-- bootstrap\n" not in b and "This file is auto generated" not in b]
    # The bootstrap part's functions (CHECKs' and triggers' own, sql/schema.sql)
    # come first, replaced in place: the hand-written table changes may need them.
    bootstrap = "".join(b for b in blocks if "\n-- bootstrap\n" in b)
    early = [re.sub(r"^CREATE\s+FUNCTION", "CREATE OR REPLACE FUNCTION", f) for f in functions_of(bootstrap)]
    code = [re.sub(r"^CREATE\s+FUNCTION", "CREATE OR REPLACE FUNCTION", b, flags=re.M) for b in code]
    code = [re.sub(r"^CREATE\s+VIEW", "CREATE OR REPLACE VIEW", b, flags=re.M) for b in code]
    hand = (ROOT / "sql" / "upgrade" / f"{previous}--{current}.sql").read_text()
    script = (f"-- flow {previous} -> {current}. Written by tools/upgrade_script.py: edit\n"
              f"-- sql/upgrade/{previous}--{current}.sql and the sql/*.sql it takes the code from.\n"
              f"\\echo Use \"ALTER EXTENSION flow UPDATE\" to load this file. \\quit\n\n"
              + "\n\n".join(early) + "\n\n" + hand + "\n" + "\n".join(code))
    target = ROOT / "sql" / f"flow--{previous}--{current}.sql"
    if not target.exists() or target.read_text() != script:
        target.write_text(script)
    (Path(sharedir) / "extension" / target.name).write_text(script)


if __name__ == "__main__":
    main()
