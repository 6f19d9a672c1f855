"""Every reader fed generated bad inputs (hypothesis, a fixed seed under the "ci" profile of
``tests/fuzz/strategies.py``): no input kills the reader, every input row comes out as one row with a status,
a wrong-typed config value fails naming its field before any work, SQL that writes, attaches, reads outside
the run or runs long is refused or stopped and changes nothing, every viewer answer is below 500 and a foreign
Host gets 400; a whole ``ingest`` / ``import-packs`` run twice is byte-identical and writes nothing beside its
inputs. The properties themselves live in ``tests/fuzz/targets.py`` (the bench ``python -m bench fuzz`` runs
the same ones on many more inputs)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fuzz import strategies as S
from tests.fuzz import targets as T


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return T.Workspace(tmp_path_factory.mktemp("fuzz"))


@pytest.fixture(scope="module")
def view_ws(tmp_path_factory, meaning_run):
    """The viewer's routes against the session's run with every step (the viewer's tests read it too)."""
    return T.Workspace(tmp_path_factory.mktemp("fuzz-view"), view_run=meaning_run["run"])


@given(drawn=S.wds_tar())
def test_webdataset_tars(ws, drawn):
    T.target_webdataset(drawn, ws)


@given(drawn=S.json_file())
def test_llava_and_messages_json(ws, drawn):
    T.target_json(drawn, ws)


@pytest.mark.parametrize("flavour", sorted(S.PARQUET_FLAVOURS))
@given(data=st.data())
def test_parquet_flavours(ws, flavour, data):
    T.target_parquet((flavour, data.draw(S.parquet_table(flavour))), ws)


@given(members=S.official_members())
def test_official_entries(ws, members):
    T.target_official_entry(members, ws)


@given(drawn=S.official_layout())
def test_official_folders(ws, drawn):
    T.target_official_folder(drawn, ws)


@given(data=st.data())
def test_config_wrong_types_name_their_field(ws, data):
    T.target_config(data.draw(S.config_value(T.config_fields())), ws)


@given(q=S.sql_statement())
def test_viewer_sql(ws, q):
    T.target_sql(q, ws)


@given(q=S.sql_statement(long=False))
def test_ovpipe_sql(ws, q):
    T.target_sql(q, ws, cli=True)


@given(drawn=S.route_request())
def test_viewer_routes(view_ws, drawn):
    T.target_route(drawn, view_ws)


@settings(max_examples=2)
@given(drawn=st.tuples(S.wds_tar(), S.json_file(), st.just("caption-parquet").flatmap(
    lambda f: st.tuples(st.just(f), S.parquet_table(f)))))
def test_ingest_twice_is_byte_identical(ws, drawn):
    T.step_twice("ingest", drawn, ws)


@settings(max_examples=2)
@given(tars=S.official_tars())
def test_import_packs_twice_is_byte_identical(ws, tars):
    T.step_twice("import-packs", tars, ws)
