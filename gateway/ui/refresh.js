// Fencegate dashboard: auto-refresh, on by default, paused and resumed by a visible
// control; a pause is kept in localStorage, so it survives a reload (and holds for every
// tab of this origin). Plain JavaScript, no build step, no third-party code.
"use strict";

window.FencegateRefresh = (() => {
  const KEY = "fencegate.autoRefresh"; // "paused", or absent: on
  let memory = null; // where the choice lives when localStorage cannot be used

  function paused() {
    try {
      return localStorage.getItem(KEY) === "paused";
    } catch (_error) {
      return memory === "paused";
    }
  }

  function remember(pause) {
    memory = pause ? "paused" : null;
    try {
      if (pause) localStorage.setItem(KEY, "paused");
      else localStorage.removeItem(KEY);
    } catch (_error) {
      // storage refused (a private window, a policy): the choice lasts until a reload
    }
  }

  // Every `seconds` after the last load ends, `load()` runs again, unless paused, the
  // page hidden or `busy()` (an operator editing something a reload would throw away):
  // then the next try is a period later. `button` shows the state and toggles it;
  // resuming loads at once. `loaded()` is called by the page after every load, automatic
  // or not, and starts the next period.
  function create({ seconds, load, busy, button, label }) {
    let timer = null;

    function show() {
      const on = !paused();
      button.textContent = on ? "Pause auto-refresh" : "Resume auto-refresh";
      button.setAttribute("aria-pressed", String(!on));
      button.dataset.state = on ? "on" : "paused";
      label.textContent = on ? `Refreshing every ${seconds} s` : "Auto-refresh paused";
    }

    function schedule() {
      clearTimeout(timer);
      timer = paused() ? null : setTimeout(tick, seconds * 1000);
    }

    function tick() {
      timer = null;
      if (paused()) return;
      if (document.hidden || busy()) schedule();
      else load(); // the page calls loaded() when it is done
    }

    button.addEventListener("click", () => {
      remember(!paused());
      show();
      if (paused()) schedule();
      else load();
    });
    show();
    return { loaded: schedule, paused };
  }

  return { create, KEY };
})();
