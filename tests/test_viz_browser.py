"""The visualizer page in a real headless Chromium (Debian's `chromium` and `chromium-driver`,
driven by Selenium): a prompt submitted on the page renders spans whose text joins to the
generated text, for the speculative run and the plain one beside it, and one chart bar per draft
position. Skipped, saying why, when no browser can be had."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import build_tiny_model
from server_cases import running_server

from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams
from specdecode.server.app import ServeConfig

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

NAME = "tiny"
PROMPT = "abc abc abc abc abc abc"
MAX_TOKENS = 24
K = 3
PAGE_TIMEOUT_S = 60
SCREENSHOT_ENV = "SPECDECODE_VIZ_SCREENSHOT"  # save the page's screenshot there when set


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip(
            "no headless browser: install Debian's chromium and chromium-driver "
            "(apt-get install chromium chromium-driver; `make test` does as root)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1000"):
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=driver)
    chrome = webdriver.Chrome(options=options, service=service)
    chrome.set_page_load_timeout(PAGE_TIMEOUT_S)
    try:
        yield chrome
    finally:
        chrome.quit()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    model_dir = build_tiny_model(tmp_path_factory.mktemp("viz_llama"), "llama")
    plain = LLM(model=str(model_dir), dtype="float32")
    draft = {"name": "self", "model": str(model_dir), "num_speculative_tokens": 4}
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    return plain.with_drafters([ngram, draft])


def _texts(chrome: webdriver.Chrome, selector: str) -> list[str]:
    script = "return [...document.querySelectorAll(arguments[0])].map(n => n.textContent)"
    return chrome.execute_script(script, selector)


@pytest.mark.parametrize("api_key", [None, "sekrit"])
def test_the_page_draws_a_submitted_prompt(
    browser: webdriver.Chrome, served: LLM, api_key: str | None
) -> None:
    """With --api-key, the page is opened as a browser user would after the Basic prompt
    (the key as the password): its own calls then carry the key."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    (want,) = served.generate(PROMPT, params)
    with running_server(served, ServeConfig(NAME, api_key=api_key)) as base:
        login = "" if api_key is None else f"viewer:{api_key}@"
        browser.get(f"{base.replace('://', '://' + login)}/viz")
        wait = WebDriverWait(browser, PAGE_TIMEOUT_S)
        wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#drafter option")) == 2)
        browser.find_element(By.ID, "prompt").clear()
        browser.find_element(By.ID, "prompt").send_keys(PROMPT)
        browser.find_element(By.ID, "chat").click()  # off: the raw prompt, as generate() has it
        for field, value in (("k", K), ("max-tokens", MAX_TOKENS)):
            box = browser.find_element(By.ID, field)
            box.clear()
            box.send_keys(str(value))
        browser.find_element(By.ID, "run").click()
        wait.until(
            lambda b: b.find_element(By.TAG_NAME, "body").get_attribute("data-done") == "true"
        )
        error = browser.find_element(By.ID, "error")
        assert not error.is_displayed(), error.text
        assert "".join(_texts(browser, "#spec-text .tok")) == want.text
        assert "".join(_texts(browser, "#plain-text .tok")) == want.text
        roles = browser.execute_script(
            "return [...document.querySelectorAll('#spec-text .tok')].map(n => n.className)"
        )
        assert {r.split()[1] for r in roles} <= {"accepted", "correction", "bonus", "sampled"}
        assert "tok accepted" in roles  # the repetitive prompt is drafted right
        plain_roles = browser.execute_script(
            "return [...document.querySelectorAll('#plain-text .tok')].map(n => n.className)"
        )
        assert set(plain_roles) == {"tok sampled"}
        bars = browser.find_elements(By.CSS_SELECTOR, "#chart rect.bar")
        assert [b.get_attribute("data-position") for b in bars] == [str(i) for i in range(1, K + 1)]
        assert float(bars[0].get_attribute("data-rate")) > 0
        assert "speedup" in browser.find_element(By.ID, "speedup").text
        title = browser.find_element(By.CSS_SELECTOR, "#spec-text .tok").get_attribute("title")
        assert title.startswith("step 0:")
        if os.environ.get(SCREENSHOT_ENV):
            Path(os.environ[SCREENSHOT_ENV]).write_bytes(browser.get_screenshot_as_png())
