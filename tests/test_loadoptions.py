"""The vLLM load format's options, checked without vLLM: each wrongly typed or out-of-range value is one
LoaderOptionError (a UserError) naming the option, its value and what it takes; good values come out typed."""
import json
import os

import pytest

from p2pweights.errors import LoaderOptionError, UserError
from p2pweights.loaders.loadoptions import DEFAULT_TIMEOUT, options

MID = "ab" * 32


def test_good_options_come_out_typed(tmp_path):
    extra = {"parent": "10.0.0.1:7420", "model_id": MID.upper()[:16], "linger": True, "timeout": 30}
    opts = options(json.dumps(extra), str(tmp_path), env={})
    assert opts["parent"] == "10.0.0.1:7420" and opts["model_id"] == MID[:16]
    assert opts["linger"] is True and opts["timeout"] == 30.0 and opts["out"] == str(tmp_path)
    env = {"P2PW_LINGER": "off", "P2PW_TIMEOUT": "2.5", "P2PW_OUT": "copy", "P2PW_AGENT": "/var/agent"}
    opts = options(None, str(tmp_path), env=env)
    assert opts["linger"] is False and opts["timeout"] == 2.5 and opts["out"] == os.path.abspath("copy")
    assert opts["agent"] == "/var/agent" and opts["parent"] is None and opts["key"] is None
    assert options("", str(tmp_path), env={})["timeout"] == DEFAULT_TIMEOUT
    assert options({"timeout": None, "linger": 0}, str(tmp_path), env={"P2PW_TIMEOUT": "9"})["timeout"] == 9.0


@pytest.mark.parametrize("extra, env, named", [
    ({"timeout": "NaN"}, {}, "timeout='NaN' in --model-loader-extra-config: takes seconds"),
    ('{"timeout": NaN}', {}, "timeout=nan in --model-loader-extra-config: takes seconds"),
    ({"timeout": float("inf")}, {}, "timeout=inf"),
    ({"timeout": -5}, {}, "timeout=-5"),
    ({"timeout": 0}, {}, "timeout=0"),
    ({"timeout": True}, {}, "timeout=True"),
    ({"timeout": [1]}, {}, "timeout=[1]"),
    ({"timeout": "1e999"}, {}, "timeout='1e999'"),
    (None, {"P2PW_TIMEOUT": "-1"}, "timeout='-1' (P2PW_TIMEOUT): takes seconds, a finite number above 0"),
    (None, {"P2PW_TIMEOUT": "soon"}, "timeout='soon' (P2PW_TIMEOUT)"),
    ({"linger": "maybe"}, {}, "linger='maybe' in --model-loader-extra-config: takes true or false"),
    ({"linger": 2}, {}, "linger=2"),
    ({"linger": {"on": 1}}, {}, "linger={'on': 1}"),
    ({"parent": 7420}, {}, "parent=7420 in --model-loader-extra-config: takes HOST:PORT"),
    ({"parent": "host:99999"}, {}, "parent='host:99999'"),
    ({"parent": ["a:1"]}, {}, "parent=['a:1']"),
    ({"model_id": 12345678}, {}, "model_id=12345678 in --model-loader-extra-config: takes a model id"),
    ({"model_id": "not-hex-at-all-here"}, {}, "model_id='not-hex-at-all-here'"),
    ({"out": 3}, {}, "out=3 in --model-loader-extra-config: takes a folder path"),
    ({"key": {"dir": "k"}}, {}, "key={'dir': 'k'}"),
    ({"agent": False}, {}, "agent=False"),
    ({"model": 1.5}, {}, "model=1.5"),
])
def test_a_bad_option_is_one_error_naming_it(tmp_path, extra, env, named):
    with pytest.raises(LoaderOptionError) as e:
        options(extra, str(tmp_path), env=env)
    assert isinstance(e.value, UserError) and named in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("extra, said", [
    ("[1, 2]", "must be a JSON object"),
    ("3", "must be a JSON object"),
    ('"parent"', "must be a JSON object"),
    ("{not json", "is not JSON"),
    ({"parnet": "a:1"}, "unknown p2pweights option 'parnet'"),
    ({1: "a"}, "unknown p2pweights option '1'"),
])
def test_a_bad_extra_config_is_one_error(tmp_path, extra, said):
    with pytest.raises(LoaderOptionError, match=said):
        options(extra, str(tmp_path), env={})
