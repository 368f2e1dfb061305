"""The house's rules, checked on the sources (no server needed): every call
of user code goes through the gateway, each engine invariant written in
several places is the same everywhere, and no comment cites a rule or a
file the repository does not have. (docs/DESIGN.md says why each holds.)"""
import re

from conftest import ROOT

SRC = {p.name: p.read_text() for p in (ROOT / "src").glob("*.rs")}
# the engine's SQL as written (not the generated upgrade scripts or released ones)
SQL = {p.name: p.read_text() for p in (ROOT / "sql").glob("*.sql") if not p.name.startswith("flow--")}


def test_user_code_is_called_only_through_the_gateway():
    """The places that switch to another role, call a handler or run an
    args check are gateway.rs's alone: a new call of user code elsewhere
    fails this test (and test_security.py's canary checks each path at run
    time)."""
    for name, text in SRC.items():
        if name != "gateway.rs":
            assert "SetUserIdAndSecContext" not in text, name
            assert "_args_misfit(" not in text, name
            assert "AfterTriggerFireDeferred" not in text, name
    # the handler is called in one place, inside the gateway
    calls = [line for name, text in SRC.items() for line in text.splitlines()
             if "call_handler(" in line and "fn call_handler" not in line and not line.strip().startswith("//")]
    assert calls and all("gateway::run_handler(" in line for line in calls), calls
    users = sorted(name for name, text in SQL.items() if "_args_misfit_as(" in text)
    assert users == ["definitions.sql", "enqueue.sql"], users
    assert sum(text.count("flow._args_misfit(") for text in SQL.values()) == 1   # its definition


def sql_functions():
    """Each engine function's name and its source text, from sql/*.sql."""
    functions = {}
    for text in SQL.values():
        for m in re.finditer(r"^CREATE FUNCTION flow\.(\w+)\(.*?\$\$;", text, re.M | re.S):
            functions.setdefault(m.group(1), "")
            functions[m.group(1)] += m.group(0)
    return functions


def test_every_hot_engine_function_has_the_planner_settings():
    """The functions the engine's Rust calls, and those they call, that read
    flow's tables are on the hot path's list (sql/api.sql), which gives them
    the planner settings of docs/DESIGN.md section 5."""
    listed = set(re.findall(r"'(_\w+)'", SQL["api.sql"].split("the hot path")[-1]))
    functions = sql_functions()
    called = {name for text in SRC.values() for name in re.findall(r"flow\.(_\w+)\(", text)}
    hot = set()
    for name in called:
        body = functions.get(name, "")
        callees = set(re.findall(r"flow\.(_\w+)\(", body)) - {name}
        for f in {name} | callees:
            body = functions.get(f, "")
            # (a LANGUAGE sql helper is inlined into its caller's statements, and takes its settings)
            if "LANGUAGE plpgsql" in body and re.search(r"flow\._(commands|runs|queues|definitions|attempts|waits|events)\b", body):
                hot.add(f)
    # (what reads the catalog or a role's settings only, or runs user code, is not hot)
    # (and a schedule's tick is an enqueue as a client's: flow._enqueue keeps a client's settings)
    hot -= {"_search_path_of", "_args_misfit", "_owns_anything", "_reassign_owned", "_enqueue"}
    # (called only from listed functions, flow._claim and flow._next_due_ms, under their settings:
    # a SET clause of their own would cost each call its setting and its reverting)
    hot -= {"_claim_ranges", "_groups_of"}
    assert hot, "no hot function found: the test reads the sources wrongly"
    assert sorted(hot - listed) == [], "hot functions missing from sql/api.sql's list"
    assert sorted(listed - set(functions)) == [], "listed functions that do not exist"


def test_every_statement_that_clears_a_lease_clears_all_of_it():
    """A lease is several columns of _commands; a statement that clears one
    (lease_token = NULL) clears every one, or a command would keep half a
    lease (and the row CHECK would refuse it, src/invariants.rs)."""
    table = re.search(r"CREATE TABLE flow\._commands \((.*?)\n\);", SQL["schema.sql"], re.S).group(1)
    columns = re.findall(r"^\s+(\w+)\s", table, re.M)
    lease = {c for c in columns if c.startswith("lease_")} | {"attempt_started_at", "attempt_deadline"}
    assert len(lease) >= 7, lease
    statements = [stmt for text in SQL.values() for stmt in re.split(r";\s*\n", text) if "lease_token = NULL" in stmt]
    assert len(statements) >= 3
    for stmt in statements:
        cleared = set(re.findall(r"\b(\w+) = NULL\b", stmt))
        assert lease <= cleared, f"lease columns left set: {sorted(lease - cleared)} in:\n{stmt[:400]}"


def test_a_root_alone_is_one_clause_everywhere():
    """'A root with no child' is written out where it is used (an SQL
    function with a subquery is never inlined): each copy is the same
    clause, and marked."""
    clause = re.compile(r"NOT EXISTS \(SELECT 1 FROM flow\._commands k WHERE k\.parent_id = \w+\.id\)")
    places = []
    for name, text in SQL.items():
        for line in text.splitlines():
            if "k.parent_id =" in line:
                assert clause.search(line) and line.rstrip().endswith("-- alone: docs/DESIGN.md"), f"{name}: {line}"
                places.append(name)
    assert sorted(places) == ["claim.sql", "common.sql", "external.sql", "settle.sql"], places
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    assert "NOT EXISTS (SELECT 1 FROM flow._commands k WHERE k.parent_id = <the root's\nid>)" in design


def test_comments_cite_only_rules_and_files_that_exist():
    """Every "rule N" is one of docs/DESIGN.md's rules, and every path a
    comment or document names is in the repository."""
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    rules = {int(n) for n in re.findall(r"^### Rule (\d+):", design, re.M)}
    assert rules == set(range(1, 13))
    files = [*ROOT.glob("src/*.rs"), *ROOT.glob("sql/*.sql"), *ROOT.glob("sql/upgrade/*.sql"),
             *ROOT.glob("pg_test/*.py"), *ROOT.glob("benches/*.py"), *ROOT.glob("tools/*"),
             ROOT / "docs" / "DESIGN.md", ROOT / "README.md", ROOT / "benches" / "README.md"]
    path = re.compile(r"(?<![/\w.-])((?:src|sql|pg_test|tools|benches|docs|examples)/[A-Za-z0-9_./-]*[A-Za-z0-9_])")
    missing = []
    for f in files:
        if f.name.startswith("flow--") or not f.is_file():
            continue
        for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            for n in re.findall(r"\brules? (\d+)(?:[-–](\d+))?(?![.\d])", line):
                cited = set(range(int(n[0]), int(n[1] or n[0]) + 1))
                if not cited <= rules:
                    missing.append(f"{f.relative_to(ROOT)}:{i}: rule {n}")
            for p in path.findall(line):
                p = p.rstrip(".")
                if "<" in line[line.find(p):line.find(p) + len(p) + 2] or p.endswith("flow"):
                    continue   # a pattern such as sql/flow--<old>--<new>.sql
                if not (ROOT / p).exists():
                    missing.append(f"{f.relative_to(ROOT)}:{i}: {p}")
    assert missing == [], "\n".join(missing)
