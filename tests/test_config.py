import logging
import re
from pathlib import Path

import pytest

from kvstrata.config import (
    MAX_TIER_BLOCKS,
    ConfigError,
    KvConfig,
    ModelGeometry,
    TierConfig,
    load_config,
    parse_size,
    parse_tiers_flag,
    unknown_env_vars,
)


def test_defaults_are_valid():
    config = load_config(env={})
    assert config.block_size == 16 and set(config.tiers) == {"G1", "G2", "G3"}
    assert config.tier_eviction("G1") == "default"
    assert config.tier_admission("G3") == "predicted-reuse"      # the bottom tier filters
    assert config.tier_admission("G1") == config.tier_admission("G2") == "always"


def test_kwargs_override_everything(tmp_path):
    path = tmp_path / "kv.toml"
    path.write_text('block_size = 32\npolicy = "lru"\n[tiers.G1]\nblocks = 10\n')
    config = load_config(path, env={"KVSTRATA_BLOCK_SIZE": "64"}, block_size=128)
    assert config.block_size == 128 and config.eviction == "lru"
    assert config.tiers == {"G1": TierConfig(blocks=10)}


def test_toml_file(tmp_path):
    path = tmp_path / "kv.toml"
    path.write_text(
        'block_size = 32\neviction = "lfu"\nadmission = "second-offer"\n'
        '[model]\nnum_layers = 2\nkv_heads = 2\nhead_dim = 64\ndtype = "fp16"\n'
        '[tiers.G1]\nblocks = 100\n[tiers.G2]\nbytes = "1MiB"\neviction = "lru"\n'
        '[tiers.G3]\ngb = 0.001\nadmission = "always"\npath = "/tmp/x"\n'
    )
    config = load_config(path, env={})
    assert config.bytes_per_block == 2 * 2 * 32 * 2 * 64 * 2  # 32 KiB
    assert config.tier_blocks("G2") == 32 and config.tier_eviction("G2") == "lru"
    assert config.tier_blocks("G3") == int(0.001 * 1024**3) // 32768
    assert config.tier_admission("G3") == "always"    # its own
    # The global filter is the bottom tier's; the tiers above it admit every block, since a
    # block they refused would never reach the tiers below (write-through).
    assert config.tier_admission("G1") == config.tier_admission("G2") == "always"
    bottom_g2 = load_config(None, env={}, tiers={"G1": 10, "G2": 20}, admission="second-offer")
    assert bottom_g2.tier_admission("G2") == "second-offer"
    assert bottom_g2.tier_admission("G1") == "always"


def test_env_vars_and_dynamo_aliases():
    env = {
        "KVSTRATA_BLOCK_SIZE": "32",
        "KVSTRATA_G1_BLOCKS": "500",
        "DYN_KVBM_CPU_CACHE_GB": "2",
        "DYN_KVBM_DISK_CACHE_GB": "10",
        "DYN_KVBM_DISK_CACHE_DIR": "/mnt/nvme",
        "KVSTRATA_POLICY": "lfu",
    }
    config = load_config(env=env)
    assert config.block_size == 32 and config.tier_blocks("G1") == 500
    assert config.tiers["G2"].bytes == 2 * 1024**3 and config.tiers["G3"].bytes == 10 * 1024**3
    assert config.disk_dir == "/mnt/nvme" and config.eviction == "lfu"


def test_kvstrata_env_wins_over_dynamo_alias():
    config = load_config(env={"DYN_KVBM_CPU_CACHE_GB": "2", "KVSTRATA_G2_BLOCKS": "77"})
    assert config.tiers["G2"].blocks == 77 and config.tiers["G2"].bytes is None


def test_one_error_names_every_problem(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(
            env={"KVSTRATA_BLOCK_SIZE": "abc"},
            tiers={"G1": 0, "G9": 5, "G2": {"bytes": "lots"}},
            eviction="magic",
            admission="never",
        )
    text = str(err.value)
    for fragment in ("KVSTRATA_BLOCK_SIZE", "G9", "tier G1: blocks", "tier G2", "magic", "never"):
        assert fragment in text, fragment
    assert len(err.value.problems) >= 6


def test_missing_file_and_bad_toml(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("block_size = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad, env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml", env={})


def test_validate_rejects_bad_direct_construction():
    with pytest.raises(ConfigError, match="G1 is required"):
        KvConfig(tiers={"G2": TierConfig(blocks=4)}).validate()


@pytest.mark.parametrize("text, expected", [("4096", 4096), ("4GiB", 4 * 1024**3),
                                            ("2.5GB", 2_500_000_000), ("1 MiB", 1024**2)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_tiers_flag():
    tiers = parse_tiers_flag("G1=1000, G2=4GiB,g3=1_000")
    assert tiers["G1"].blocks == 1000 and tiers["G2"].bytes == 4 * 1024**3
    assert tiers["G3"].blocks == 1000
    with pytest.raises(ConfigError):
        parse_tiers_flag("G1")


def test_env_beats_toml(tmp_path):
    path = tmp_path / "kv.toml"
    path.write_text('block_size = 32\n[tiers.G1]\nblocks = 10\n')
    config = load_config(path, env={"KVSTRATA_BLOCK_SIZE": "64", "KVSTRATA_G1_BLOCKS": "20"})
    assert config.block_size == 64 and config.tier_blocks("G1") == 20


def test_native_disk_dir_beats_dynamo_alias():
    env = {"DYN_KVBM_DISK_CACHE_DIR": "/dyn", "KVSTRATA_DISK_DIR": "/native"}
    assert load_config(env=env).disk_dir == "/native"
    assert load_config(env={"DYN_KVBM_DISK_CACHE_DIR": "/dyn"}).disk_dir == "/dyn"


@pytest.mark.parametrize(
    "env, text",
    [
        ({"KVSTRATA_G2_GB": "inf"}, ""),
        ({}, "model = 5\n"),
        ({}, "[tiers.G1]\nbytes = inf\n"),
        ({}, 'policy = "lru"\neviction = "lfu"\n'),
        ({"KVSTRATA_POLICY": "lru", "KVSTRATA_EVICTION": "lfu"}, ""),
        ({}, "block_size = true\n"),
        ({"KVSTRATA_ENCRYPT_AT_REST": "maybe"}, ""),
        ({}, 'encrypt_at_rest = "yes"\n'),
    ],
)
def test_more_bad_input_is_a_config_error(tmp_path, env, text):
    path = tmp_path / "kv.toml"
    path.write_text(text)
    with pytest.raises(ConfigError):
        load_config(path, env=env)


def test_toml_tier_size_string(tmp_path):
    path = tmp_path / "kv.toml"
    path.write_text('[tiers]\nG1 = 100\nG2 = "4MiB"\n')
    config = load_config(path, env={})
    assert config.tiers["G1"].blocks == 100 and config.tiers["G2"].bytes == 4 * 1024**2


@pytest.mark.parametrize("model", [{"num_layers": True}, {"kv_heads": False},
                                   {"head_dim": True}, {"outer_dim": True}])
def test_booleans_are_not_numbers(model):
    with pytest.raises(ConfigError):
        load_config(env={}, model=ModelGeometry(**model))


def test_booleans_are_not_sizes():
    with pytest.raises(ConfigError):
        KvConfig(tiers={"G1": TierConfig(blocks=True)}).validate()
    with pytest.raises(ConfigError):
        KvConfig(tiers={"G1": TierConfig(bytes=True)}).validate()


def test_a_tier_named_twice_in_the_flag_is_refused():
    from kvstrata.config import parse_tiers_flag

    with pytest.raises(ConfigError, match="twice"):
        parse_tiers_flag("G1=1,G1=2")


@pytest.mark.parametrize("tier, size", [
    ("G1", TierConfig(blocks=2**31 - 2)),
    ("G2", TierConfig(blocks=10**23)),
    ("G4", TierConfig(bytes=(2**31 - 2) * 131072)),      # 128 KiB blocks at the defaults
])
def test_a_tier_of_more_blocks_than_a_pool_holds_is_refused_naming_it(tier, size):
    tiers = {"G1": TierConfig(blocks=8), tier: size}
    with pytest.raises(ConfigError, match=f"tier {tier}: .* more than a tier holds"):
        KvConfig(tiers=tiers).validate()
    ok = {"G1": TierConfig(blocks=8), tier: TierConfig(blocks=MAX_TIER_BLOCKS)}
    assert KvConfig(tiers=ok).validate().tier_blocks(tier) == 2**31 - 3
    assert KvConfig(tiers={**ok, tier: TierConfig(bytes=MAX_TIER_BLOCKS * 131072)}
                    ).validate().tier_blocks(tier) == MAX_TIER_BLOCKS


def test_encrypt_at_rest_from_toml_and_environment(tmp_path):
    path = tmp_path / "kv.toml"
    path.write_text("encrypt_at_rest = true\n")
    assert load_config(path, env={}).encrypt_at_rest is True
    assert load_config(env={"KVSTRATA_ENCRYPT_AT_REST": "1"}).encrypt_at_rest is True
    assert load_config(path, env={"KVSTRATA_ENCRYPT_AT_REST": "off"}).encrypt_at_rest is False
    assert load_config(env={}).encrypt_at_rest is False


@pytest.mark.parametrize("url", ["http://admin:S3CRET-PASSWORD@127.0.0.1:9000/kv",
                                 "http://admin:S3CRET-PASSWORD@127.0.0.1:99999/bucket",
                                 "http://127.0.0.1:9000/kv?X-Amz-Signature=S3CRET-PASSWORD"])
def test_a_refused_object_store_url_never_shows_its_credentials(url):
    tiers = {"G1": TierConfig(blocks=4), "G2": TierConfig(blocks=4),
             "G4": TierConfig(blocks=4, url=url)}
    with pytest.raises(ConfigError) as refused:
        KvConfig(tiers=tiers).validate()
    assert "S3CRET-PASSWORD" not in str(refused.value)


@pytest.mark.parametrize("toml, problem", [
    ('keep_tokens = "false"\n', "keep_tokens must be true or false"),
    ('[tiers.G1]\nblocks = 8\n[tiers.G2]\nbytes = "1GiB"\ngb = 64\n', "not bytes and gb"),
    ('[tiers.G1]\nblocks = 8\n[tiers.G2]\ngb = true\n', "gb must be a number"),
    ('[tiers]\nG1 = 1000\nG2 = 4e9\n', "neither a number of blocks"),
])
def test_values_that_would_be_read_as_something_else_are_refused(tmp_path, toml, problem):
    """A string "false" was a true keep_tokens, gb beside bytes was ignored, gb = true was
    1 GiB, and a float tier size was bytes where an integer is blocks."""
    path = tmp_path / "kv.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=problem):
        load_config(path, env={})


def test_a_tier_sized_twice_in_the_environment_is_refused():
    with pytest.raises(ConfigError, match="not bytes and gb"):
        load_config(env={"KVSTRATA_G2_BYTES": "1GiB", "KVSTRATA_G2_GB": "64"})


@pytest.mark.parametrize("build", [
    lambda: KvConfig(tiers={"G1": 5}).validate(),
    lambda: KvConfig(tiers=5).validate(),
    lambda: KvConfig(model=5).validate(),
    lambda: load_config(tiers=5, env={}),
    lambda: load_config(model={"num_layers": 2}, env={}),
])
def test_parts_of_the_wrong_type_from_the_python_api_are_config_errors(build):
    with pytest.raises(ConfigError):
        build()


def test_an_unknown_kvstrata_variable_is_warned_about_once(caplog):
    env = {"KVSTRATA_G2_GIB": "8", "KVSTRATA_G2_BLOCKS": "64", "KVSTRATA_TENANT": "a",
           "KVSTRATA_NATS_TOKEN": "t" * 20, "DYN_KVBM_METRICS": "true"}
    with caplog.at_level(logging.WARNING, logger="kvstrata.config"):
        config = load_config(env=env)
        load_config(env=env)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "KVSTRATA_G2_GIB" in warned[0]
    assert config.tiers["G2"].blocks == 64  # the known variables still apply


def test_every_kvstrata_variable_the_project_reads_is_known():
    root = Path(__file__).resolve().parent.parent
    names = set()
    for folder in ("src", "scripts", "bench"):
        for path in (root / folder).rglob("*"):
            if path.is_file() and path.suffix in ("", ".py", ".sh"):
                names |= set(re.findall(r"KVSTRATA_[A-Z0-9_]*[A-Z0-9]",
                                        path.read_text(errors="replace")))
    names -= {"KVSTRATA_G"}  # "KVSTRATA_Gn_*" in prose
    assert "KVSTRATA_WEED" in names and "KVSTRATA_GPU_OUT" in names
    assert unknown_env_vars(dict.fromkeys(names, "")) == []
