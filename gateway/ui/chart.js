// Fencegate dashboard: the refusals chart (a canvas), drawn by app.js through
// window.FencegateChart. Plain JavaScript, no build step, no third-party code.
//
// Time labels fall on round UTC times (every 1, 5, 15 or 30 minutes, 1, 3, 6 or 12
// hours, 1 or 7 days, ...): the smallest such step whose labels do not crowd each other,
// each placed at its own time on the axis, wherever the buckets begin.
"use strict";

window.FencegateChart = (() => {
  const MINUTE = 60;
  const HOUR = 3600;
  const DAY = 86400;
  // The steps between two labels, in seconds; each a divisor of the next larger unit, so
  // multiples of it since the epoch are round times in UTC.
  const TICK_STEPS = [
    1, 2, 5, 10, 15, 30,
    MINUTE, 2 * MINUTE, 5 * MINUTE, 10 * MINUTE, 15 * MINUTE, 30 * MINUTE,
    HOUR, 2 * HOUR, 3 * HOUR, 6 * HOUR, 12 * HOUR,
    DAY, 2 * DAY, 7 * DAY, 14 * DAY, 28 * DAY,
  ];
  const MIN_LABEL_GAP = 90; // CSS pixels between two labels, at the least

  // The labels' step and times for [start, end) seconds drawn over `width` pixels: the
  // smallest step of TICK_STEPS at least `minGap` pixels wide (never finer than a
  // bucket), and its multiples inside the range.
  function timeTicks(start, end, width, minGap, bucketSeconds) {
    const span = Math.max(end - start, 1e-9);
    const perSecond = width / span;
    const floor = Math.max(bucketSeconds || 0, 1);
    let step = TICK_STEPS.find((s) => s >= floor && s * perSecond >= minGap);
    if (step === undefined) {
      // Longer than every step: whole multiples of four weeks.
      const weeks = Math.ceil(minGap / perSecond / (28 * DAY));
      step = Math.max(1, weeks) * 28 * DAY;
    }
    const times = [];
    for (let t = Math.ceil(start / step) * step; t < end; t += step) times.push(t);
    return { step, times };
  }

  // A label for `seconds` since the epoch: as much of "MM-DD HH:MM:SS" (UTC) as the step
  // and the span need.
  function tickLabel(seconds, step, span) {
    const text = new Date(seconds * 1000).toISOString(); // 2026-12-06T09:15:00.000Z
    const date = text.slice(5, 10);
    const time = step < MINUTE ? text.slice(11, 19) : text.slice(11, 16);
    if (step >= DAY) return date;
    if (span > DAY || (step >= HOUR && time === "00:00")) return `${date} ${time}`;
    return time;
  }

  function niceStep(raw) {
    const power = Math.pow(10, Math.floor(Math.log10(Math.max(raw, 1))));
    for (const m of [1, 2, 5, 10]) if (m * power >= raw) return Math.max(1, m * power);
    return 10 * power;
  }

  // Draws `series` (the refusals-over-time answer) on `canvas`, one stacked bar per
  // bucket, `colour(reason)` for each segment; returns what the tooltip needs.
  function draw(canvas, series, colour) {
    const scale = window.devicePixelRatio || 1;
    const width = Math.max(1, Math.round(canvas.clientWidth * scale));
    const height = Math.max(1, Math.round(canvas.clientHeight * scale));
    canvas.width = width;
    canvas.height = height;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.fillStyle = "#ffffff";
    ctx.fillRect(0, 0, width, height);
    if (!series) return null;

    const left = Math.round(48 * scale);
    const right = Math.round(12 * scale);
    const top = Math.round(12 * scale);
    const bottom = Math.round(30 * scale);
    const plotW = width - left - right;
    const plotH = height - top - bottom;
    const base = top + plotH;
    const buckets = series.buckets;
    const n = buckets.length;
    const maxTotal = buckets.reduce((m, b) => Math.max(m, b.total), 0);
    const step = niceStep(Math.max(maxTotal, 1) / 4);
    const ymax = Math.max(step, Math.ceil(maxTotal / step) * step);

    // Grid and y labels.
    ctx.font = `${Math.round(11 * scale)}px system-ui, sans-serif`;
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    for (let v = 0; v <= ymax; v += step) {
      const y = base - Math.round((v / ymax) * plotH);
      ctx.fillStyle = "#e4e7eb";
      ctx.fillRect(left, y, plotW, Math.max(1, Math.round(scale)));
      ctx.fillStyle = "#52606d";
      ctx.fillText(String(v), left - Math.round(6 * scale), y);
    }

    // Stacked bars: one per bucket, one segment per reason.
    const slot = plotW / n;
    const barW = Math.max(1, Math.floor(Math.min(slot * 0.8, 48 * scale)));
    buckets.forEach((bucket, i) => {
      const x = Math.round(left + i * slot + (slot - barW) / 2);
      let sum = 0;
      for (const reason of series.reasons) {
        const count = bucket.counts[reason];
        if (!count) continue;
        const y0 = base - Math.round((sum / ymax) * plotH);
        sum += count;
        const y1 = base - Math.round((sum / ymax) * plotH);
        ctx.fillStyle = colour(reason);
        ctx.fillRect(x, y1, barW, Math.max(1, y0 - y1));
      }
    });

    // X axis, and labels at round times (UTC), each at its time's place on the axis.
    ctx.fillStyle = "#9aa5b1";
    ctx.fillRect(left, base, plotW, Math.max(1, Math.round(scale)));
    const start = n ? Date.parse(buckets[0].start) / 1000 : 0;
    const end = n ? Date.parse(buckets[n - 1].end) / 1000 : 1;
    const span = Date.parse(series.until) / 1000 - Date.parse(series.since) / 1000;
    const ticks = timeTicks(start, end, plotW / scale, MIN_LABEL_GAP, series.bucket_seconds);
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    const labels = [];
    for (const t of ticks.times) {
      const x = Math.round(left + ((t - start) / (end - start)) * plotW);
      const label = tickLabel(t, ticks.step, span);
      const half = ctx.measureText(label).width / 2;
      ctx.fillStyle = "#9aa5b1";
      ctx.fillRect(x, base, Math.max(1, Math.round(scale)), Math.round(4 * scale));
      if (x - half < 0 || x + half > width) continue; // would be cut at the edge
      ctx.fillStyle = "#52606d";
      ctx.fillText(label, x, base + Math.round(8 * scale));
      labels.push(new Date(t * 1000).toISOString());
    }
    canvas.dataset.tickStep = String(ticks.step);
    canvas.dataset.ticks = labels.join(" ");

    if (maxTotal === 0) {
      ctx.fillStyle = "#616e7c";
      ctx.textBaseline = "middle";
      ctx.fillText("No refusals in this window", left + plotW / 2, top + plotH / 2);
    }
    canvas.dataset.drawn = String(buckets.filter((b) => b.total > 0).length);
    return { left, top, plotH, slot, scale, n };
  }

  // The window "since the first entry": from the audit's oldest entry (ISO time, or
  // null when it holds none) to the window's end (the server's now), in whole hours, at
  // least one (a fresh install's minutes are not one bar of a day), at most maxSeconds.
  function windowFromData(firstAt, until, maxSeconds) {
    if (!firstAt) return HOUR;
    const span = (Date.parse(until) - Date.parse(firstAt)) / 1000;
    return Math.min(maxSeconds, Math.max(1, Math.ceil(span / HOUR)) * HOUR);
  }

  return { draw, timeTicks, tickLabel, windowFromData, TICK_STEPS, MIN_LABEL_GAP };
})();
