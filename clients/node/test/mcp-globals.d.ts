// The MCP SDK's declarations name the DOM's `HeadersInit`, which Node's
// types (this package compiles without the DOM library) give only as
// `Headers`' constructor argument.
declare global {
  type HeadersInit = ConstructorParameters<typeof Headers>[0];
}
export {};
