/* The sign-in form, shown while the server refuses the page's token (or it has none). */

import { h } from "../dom.js";

/** refused: the server's refusal when a token was sent (null when none was). */
export function authView(refused) {
  document.title = "Tally · sign in";
  return [
    h(
      "form",
      { class: "panel empty empty-big auth", "data-action": "signin", "data-testid": "signin" },
      h("div", { class: "empty-title" }, "This Tally server needs a token"),
      h("div", {}, "Enter a bearer token (any role can read the dashboard). It is kept in this browser tab only."),
      refused ? h("div", { class: "auth-error", "data-testid": "auth-error" }, `The token was not accepted: ${refused.message}`) : null,
      h(
        "div",
        { class: "auth-row" },
        h("input", {
          class: "btn auth-input",
          type: "password",
          name: "token",
          autocomplete: "current-password",
          placeholder: "token",
          "aria-label": "Bearer token",
        }),
        h("button", { class: "btn", type: "submit" }, "Sign in"),
      ),
    ),
  ];
}
