"""Browser tests of the run pages (headless Chromium driven by Playwright)."""
