// Shared by the console's pages: the API key (kept in this browser only) and request headers.
const Stratum = {
  key() { return localStorage.getItem("stratum-api-key") || ""; },
  headers(extra) {
    const h = { "content-type": "application/json", "anthropic-version": "2023-06-01", ...(extra || {}) };
    if (Stratum.key()) h["x-api-key"] = Stratum.key();
    return h;
  },
  bindKey() {
    const input = document.getElementById("api-key");
    input.value = Stratum.key();
    input.addEventListener("change", () => localStorage.setItem("stratum-api-key", input.value.trim()));
  },
};
