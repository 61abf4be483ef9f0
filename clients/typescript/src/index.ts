export * from "./errors.js";
export * from "./client.js";
