// A small syntax highlighter for code blocks: comments, strings, numbers and the keywords of common languages,
// as spans whose text is set with textContent (never HTML).
const KEYWORDS = new Set(("and as assert async await break case catch class const continue def default del do elif else " +
  "enum except export extends false False finally fn for from func function go if impl import in interface is " +
  "lambda let loop match mod mut new nil None not null or package pass pub raise return self static struct super " +
  "switch this throw true True try type typeof use var void while with yield int float double char bool string " +
  "long unsigned signed auto public private protected include define echo fi then done esac local").split(" "));

const HASH_COMMENTS = /^(py|python|sh|bash|shell|zsh|ruby|rb|r|yaml|yml|toml|perl|pl|make|makefile|dockerfile|conf)$/i;
const DASH_COMMENTS = /^(sql|lua|hs|haskell)$/i;
const TRIPLE = ["\"\"\"[\\s\\S]*?\"\"\"", "'''[\\s\\S]*?'''"];
const QUOTED = ["\"(?:\\\\.|[^\"\\\\\\n])*\"", "'(?:\\\\.|[^'\\\\\\n])*'", "`(?:\\\\.|[^`\\\\])*`"];
const STRINGS = [...TRIPLE, ...QUOTED].join("|");
const NUMBERS = "\\b0x[\\da-f]+\\b|\\b\\d[\\d_]*(?:\\.\\d+)?(?:e[+-]?\\d+)?\\b";

function pattern(lang) {
  const comment = HASH_COMMENTS.test(lang || "") ? "#[^\\n]*"
    : DASH_COMMENTS.test(lang || "") ? "--[^\\n]*" : "\\/\\/[^\\n]*|\\/\\*[\\s\\S]*?\\*\\/";
  return new RegExp(`(${comment})|(${STRINGS})|(${NUMBERS})|([A-Za-z_]\\w*)`, "gi");
}

export function highlight(code, text, lang) {
  const re = pattern(lang);
  let last = 0;
  const span = (cls, s) => { const e = document.createElement("span"); e.className = cls; e.textContent = s; return e; };
  for (const m of text.matchAll(re)) {
    if (m[4] !== undefined && !KEYWORDS.has(m[4])) continue;  // a plain identifier stays in the text run
    if (m.index > last) code.append(text.slice(last, m.index));
    const cls = m[1] !== undefined ? "tok-com" : m[2] !== undefined ? "tok-str" : m[3] !== undefined ? "tok-num" : "tok-kw";
    code.append(span(cls, m[0]));
    last = m.index + m[0].length;
  }
  if (last < text.length) code.append(text.slice(last));
}
