// The run pages' script: local times, and a run page that follows its run until it settles.
// Data comes from data-* attributes and the live endpoint's JSON; nothing here builds markup from run content.
(function () {
  "use strict";

  function localTimes(root) {
    var nodes = root.querySelectorAll("time[datetime]");
    for (var i = 0; i < nodes.length; i++) {
      var when = new Date(nodes[i].getAttribute("datetime"));
      if (!isNaN(when.getTime())) {
        nodes[i].textContent = when.toLocaleString();
        nodes[i].title = nodes[i].getAttribute("datetime");
      }
    }
  }

  function follow(live) {
    var url = live.getAttribute("data-live-url");
    var delay = 1000;
    var stopped = false;
    var source = null;

    // The version shown goes with each request: the server leaves out the html (and does not describe the run
    // again) while the run is still at it.
    function current() {
      return url + "?version=" + encodeURIComponent(live.getAttribute("data-version") || "");
    }

    function apply(data) {
      if (typeof data.html === "string" && data.version !== live.getAttribute("data-version")) {
        var active = document.activeElement;
        var typing = active && live.contains(active) && (active.tagName === "TEXTAREA" || active.tagName === "INPUT");
        if (!typing || data.settled) {
          live.innerHTML = data.html;  // server-rendered and escaped
          live.setAttribute("data-version", data.version);
          localTimes(live);
        }
      }
      live.setAttribute("data-status", data.status);
      if (data.settled) {
        stop();
      }
    }

    function stop() {
      stopped = true;
      if (source) {
        source.close();
        source = null;
      }
    }

    function poll() {
      if (stopped) {
        return;
      }
      fetch(current(), {credentials: "same-origin", headers: {"Accept": "application/json"}, cache: "no-store"})
        .then(function (response) {
          if (response.status === 401 || response.status === 403 || response.status === 404) {
            stop();
            return null;
          }
          return response.ok ? response.json() : null;
        })
        .then(function (data) {
          if (data) {
            apply(data);
          }
        })
        .catch(function () { /* the next poll tries again */ })
        .then(function () {
          if (!stopped) {
            // While the event stream is open it says when to look; polling is only the slow fallback then.
            window.setTimeout(poll, source ? 10 * delay : delay);
          }
        });
    }

    // The event stream, when the browser has it, makes a change show at once; polling is the steady beat.
    if (window.EventSource) {
      try {
        source = new EventSource(url.replace(/\/live$/, "/events"));
        source.onmessage = function () { /* named events only */ };
        ["step.done", "tool.done", "tool.error", "approval.requested", "run.done", "error"].forEach(function (type) {
          source.addEventListener(type, function () {
            fetch(current(), {credentials: "same-origin", headers: {"Accept": "application/json"}, cache: "no-store"})
              .then(function (response) { return response.ok ? response.json() : null; })
              .then(function (data) { if (data && !stopped) { apply(data); } })
              .catch(function () {});
          });
        });
        source.addEventListener("done", function () { if (source) { source.close(); source = null; } });
        source.onerror = function () { if (source) { source.close(); source = null; } };
      } catch (e) {
        source = null;
      }
    }
    window.setTimeout(poll, delay);
  }

  document.addEventListener("DOMContentLoaded", function () {
    localTimes(document);
    var live = document.getElementById("live");
    if (live && live.getAttribute("data-settled") !== "true") {
      follow(live);
    }
  });
})();
